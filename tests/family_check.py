"""Shared checks of a generator family against diffusers' own pipeline (tests/test_family_*.py).

`jointrl_ode` samples with jointrl's sampler (algorithm/sde.py) and the family's velocity and
front end, deterministically (every step an ODE step); a family's test runs its diffusers pipeline
from the same initial latents, steps and guidance, in float32 and in bfloat16, and compares the
timestep the transformer is given at each step, the final latents and the decoded images
(`assert_equals_pipeline` says what each dtype allows, and why).
`assert_logps_are_normal` checks that each recorded SDE log-prob is torch.distributions.Normal's
for the step's mean and std, averaged over all but the batch dimension (Flow-GRPO's convention).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from algorithm.sde import _bcast, sample, sde_mean_std
from common.loading import DTYPES
from experts.frontend import build_frontend
from experts.kinds import build_model
from tasks.base import TextPrompt
from tests.conftest import make_config

PROMPTS = ["a red circle above a blue square", "two green triangles", "a cat"]


def family_config(path: str, *extra: str):
    """A shapes-tiny config whose generator is the diffusers pipeline at `path`."""
    return make_config(f"experts.generator.model={{kind: diffusers_flow, path: {path}, max_sequence_length: 16}}",
                       *extra, preset="shapes-tiny")


def parts(config):
    """(the generator's velocity in eval mode, its front end), as a rollout worker builds them."""
    torch.set_num_threads(1)
    return build_model(config, "generator").eval(), build_frontend(config)


def initial_latents(frontend, n: int, seed: int = 0) -> torch.Tensor:
    """(n, *latent_shape) standard normal draws on the flow's (unpacked) grid."""
    return torch.randn((n, *frontend.latent_shape), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def jointrl_ode(velocity, frontend, prompts: list[str], latents: torch.Tensor, steps: int):
    """(final latents on the flow's grid, decoded images in [-1, 1]) of jointrl's deterministic sampling."""
    cond = frontend.condition([TextPrompt(p) for p in prompts], [{} for _ in prompts])
    noise = latents[:, None].expand(-1, steps + 1, *latents.shape[1:])
    states, _ = sample(lambda x, s: velocity(x, s, **cond), noise, frontend.sigmas(steps), 0.7,
                       sde=torch.zeros(steps, dtype=torch.bool))
    return states[:, -1], frontend.decode(states[:, -1])


@contextlib.contextmanager
def timesteps_given(transformer):
    """The timesteps `transformer` is called with inside the block, one (dtype, value) per step: a
    call's batch shares one timestep, and the pipelines' two calls of a step under true guidance
    (jointrl makes one) give the same."""
    seen = []
    original = transformer.forward

    def forward(*args, **kwargs):
        t = kwargs["timestep"]
        assert torch.equal(t, t[:1].expand_as(t)), t
        if not seen or seen[-1] != (t.dtype, float(t[0])):
            seen.append((t.dtype, float(t[0])))
        return original(*args, **kwargs)

    transformer.forward = forward
    try:
        yield seen
    finally:
        del transformer.forward


@dataclass
class Sampled:
    """jointrl's deterministic sampling of a family: the front end, the initial latents (on the
    flow's grid), the final latents, the decoded images in [-1, 1] and the transformer's timesteps."""
    frontend: object
    latents: torch.Tensor
    final: torch.Tensor
    image: torch.Tensor
    timesteps: list


def sampled_by_jointrl(path: str, guidance: float, steps: int, *extra: str, dtype: str = "float32") -> Sampled:
    """jointrl's deterministic sampling of the pipeline at `path` with guidance `guidance`, its
    models in `dtype`: what a family's test gives its diffusers pipeline too. The initial latents
    are representable in `dtype` (the pipeline casts the latents it is given to its dtype), so both
    start from the same values."""
    velocity, frontend = parts(family_config(path, f"experts.generator.model.guidance_scale={guidance}",
                                             f"experts.generator.model.dtype={dtype}", *extra))
    return sampled_with(velocity, frontend, steps, dtype)


def sampled_with(velocity, frontend, steps: int, dtype: str = "float32") -> Sampled:
    """jointrl's deterministic sampling of PROMPTS with `velocity` and `frontend`, from initial
    latents representable in `dtype`."""
    latents = initial_latents(frontend, len(PROMPTS)).to(DTYPES[dtype]).float()
    with timesteps_given(velocity.transformer) as timesteps:
        final, image = jointrl_ode(velocity, frontend, PROMPTS, latents, steps)
    return Sampled(frontend, latents, final, image, timesteps)


def pipeline_sampled(pipe, latents: torch.Tensor, **call) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(final latents as the pipeline returns them, its images in [0, 1], its transformer's
    timesteps) of `pipe(latents=latents, **call)`."""
    pipe.set_progress_bar_config(disable=True)
    with timesteps_given(pipe.transformer) as timesteps:
        final = pipe(latents=latents.clone(), output_type="latent", **call).images
    pixels = pipe(latents=latents.clone(), output_type="pt", **call).images
    return final, pixels, timesteps


def differences(ours: Sampled, final: torch.Tensor, reference: torch.Tensor, pixels: torch.Tensor) -> tuple:
    """(largest difference of the final latents relative to their scale, largest of the images in [0, 1])."""
    latent = float((final.float() - reference.float()).abs().max() / reference.float().abs().max())
    return latent, float(((ours.image + 1) / 2 - pixels.float()).abs().max())


def assert_equals_pipeline(ours: Sampled, final: torch.Tensor, reference: torch.Tensor, pixels: torch.Tensor,
                           timesteps: list, dtype: str, steps: int, *, images: bool = True) -> None:
    """jointrl's sampling (`ours`, with `final` its final latents in the pipeline's space) equals
    the pipeline's (`reference` latents, `pixels`, `timesteps`).

    The transformer is given the very timesteps the pipeline gives it, dtype and value, in either
    dtype. In float32 the latents and images agree to 1e-5. In bfloat16 the pipeline keeps its
    latents in the model's dtype between steps (rounding them by up to half a bf16 ulp, 2^-9 of
    their size, each step) and combines the guidance's branches in bf16, while jointrl keeps
    float32 states (the SDE's log-probs need them) and guides in float32; each later step carries
    those roundings through the velocity. So the final latents may differ by 2^-8 of their scale
    per step (two such roundings), and the images by 2^-4 of [0, 1]: both decode in bf16, whose
    steps of a pixel value are 2^-9 to 2^-8, from latents that differ as above, and the decoder
    carries the latents' differences on. `images=False` leaves the images out: where the VAE decodes
    in float32 beside a bf16 transformer (Wan), it carries the latents' bf16 differences on with the
    random tiny VAE's gain, not jointrl's; `assert_decodes_as_the_pipeline` checks its decode alone."""
    assert timesteps and ours.timesteps == timesteps, (ours.timesteps, timesteps)
    latent_tol, image_tol = (1e-5, 1e-5) if dtype == "float32" else (steps * 2 ** -8, 2 ** -4)
    latent, image = differences(ours, final, reference, pixels)
    assert latent <= latent_tol, f"final latents: largest difference {latent:.3g} of their scale"
    assert not images or image <= image_tol, f"decoded images: largest difference {image:.3g}"


@torch.no_grad()
def assert_decodes_as_the_pipeline(frontend, reference: torch.Tensor, pixels: torch.Tensor, tol: float = 1e-5) -> None:
    """jointrl's decode of the pipeline's own final latents (`reference`, the flow's space) gives the
    pipeline's images (`pixels` in [0, 1])."""
    decoded = (frontend.decode(reference.float()) + 1) / 2
    assert decoded.shape == pixels.shape, (decoded.shape, pixels.shape)
    difference = float((decoded - pixels.float()).abs().max())
    assert difference <= tol, f"decoded from the pipeline's latents: largest difference {difference:.3g}"


@torch.no_grad()
def assert_logps_are_normal(velocity, frontend, prompts: list[str], steps: int, noise_level: float = 0.7,
                            tol: float = 1e-5) -> None:
    """Every SDE step's recorded log-prob equals Normal(mean, std).log_prob(x_next) averaged over
    all but the batch dimension, with mean and std recomputed from the recorded states."""
    cond = frontend.condition([TextPrompt(p) for p in prompts], [{} for _ in prompts])
    noise = torch.randn((len(prompts), steps + 1, *frontend.latent_shape), generator=torch.Generator().manual_seed(1))
    sigmas = frontend.sigmas(steps)
    states, logps = sample(lambda x, s: velocity(x, s, **cond), noise, sigmas, noise_level,
                           sde=torch.ones(steps, dtype=torch.bool))
    for t in range(steps):
        x = states[:, t]
        v = velocity(x, sigmas[t].expand(len(prompts)), **cond)
        mean, std = sde_mean_std(x, v, _bcast(sigmas[t], x), _bcast(sigmas[t + 1], x), noise_level=noise_level,
                                 sigma_max=float(sigmas[1]))
        expected = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(states[:, t + 1]).flatten(1).mean(1)
        assert torch.allclose(logps[:, t], expected, atol=tol, rtol=tol), (t, logps[:, t], expected)


def assert_close(ours: torch.Tensor, reference: torch.Tensor, tol: float, what: str) -> None:
    """`ours` equals `reference` to `tol` (largest absolute difference, relative to the reference's scale)."""
    diff = float((ours.float() - reference.float()).abs().max())
    scale = float(reference.float().abs().max()) or 1.0
    assert diff <= tol * max(1.0, scale), f"{what}: largest difference {diff:.3g} (scale {scale:.3g})"


@torch.no_grad()
def assert_lora_reference_is_base(path: str, *extra: str) -> set[str]:
    """With random adapter weights, the LoRA model's velocity with the adapter disabled equals the
    base model's and differs with it enabled; returns the transformer modules LoRA wrapped."""
    base, frontend = parts(family_config(path, *extra))
    adapted, _ = parts(family_config(path, *extra, "experts.generator.model.lora={r: 4, alpha: 8}"))
    synced = adapted.synced_state()
    assert synced and all("lora_" in k for k in synced)
    for name, param in adapted.named_parameters():
        if "lora_" in name:
            param.copy_(torch.randn_like(param))
    cond = frontend.condition([TextPrompt(p) for p in PROMPTS], [{} for _ in PROMPTS])
    x, sigma = initial_latents(frontend, len(PROMPTS)), torch.full((len(PROMPTS),), 0.5)
    with adapted.adapter_disabled():
        reference = adapted(x, sigma, **cond)
    assert_close(reference, base(x, sigma, **cond), 1e-6, "velocity with the adapter disabled")
    assert not torch.allclose(adapted(x, sigma, **cond), reference)
    return {k.split(".lora_")[0].removeprefix("transformer.") for k in synced}


@torch.no_grad()
def assert_loads_in_bfloat16(path: str, *extra: str) -> None:
    """`dtype=bfloat16` loads the transformer in bf16; the velocity comes back float32 and finite."""
    velocity, frontend = parts(family_config(path, "experts.generator.model.dtype=bfloat16", *extra))
    assert velocity.transformer.dtype == torch.bfloat16
    cond = frontend.condition([TextPrompt(p) for p in PROMPTS], [{} for _ in PROMPTS])
    x = initial_latents(frontend, len(PROMPTS))
    v = velocity(x, torch.full((len(PROMPTS),), 0.5), **cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert torch.isfinite(frontend.decode(x)).all()
