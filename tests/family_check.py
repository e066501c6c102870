"""Shared checks of a generator family against diffusers' own pipeline (tests/test_family_*.py).

`jointrl_ode` samples with jointrl's sampler (algorithm/sde.py) and the family's velocity and
front end, deterministically (every step an ODE step); a family's test runs its diffusers pipeline
from the same initial latents, steps and guidance and compares latents and decoded images.
`assert_logps_are_normal` checks that each recorded SDE log-prob is torch.distributions.Normal's
for the step's mean and std, averaged over all but the batch dimension (Flow-GRPO's convention).
"""
from __future__ import annotations

import torch

from algorithm.sde import _bcast, sample, sde_mean_std
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
                       torch.zeros(steps, dtype=torch.bool))
    return states[:, -1], frontend.decode(states[:, -1])


def sampled_by_jointrl(path: str, guidance: float, steps: int, *extra: str):
    """(front end, initial latents, final latents, decoded images) of jointrl's deterministic
    sampling of the pipeline at `path` with guidance `guidance`: what a family's test gives its
    diffusers pipeline too."""
    velocity, frontend = parts(family_config(path, f"experts.generator.model.guidance_scale={guidance}", *extra))
    latents = initial_latents(frontend, len(PROMPTS))
    return frontend, latents, *jointrl_ode(velocity, frontend, PROMPTS, latents, steps)


@torch.no_grad()
def assert_logps_are_normal(velocity, frontend, prompts: list[str], steps: int, noise_level: float = 0.7,
                            tol: float = 1e-5) -> None:
    """Every SDE step's recorded log-prob equals Normal(mean, std).log_prob(x_next) averaged over
    all but the batch dimension, with mean and std recomputed from the recorded states."""
    cond = frontend.condition([TextPrompt(p) for p in prompts], [{} for _ in prompts])
    noise = torch.randn((len(prompts), steps + 1, *frontend.latent_shape), generator=torch.Generator().manual_seed(1))
    sigmas = frontend.sigmas(steps)
    states, logps = sample(lambda x, s: velocity(x, s, **cond), noise, sigmas, noise_level,
                           torch.ones(steps, dtype=torch.bool))
    for t in range(steps):
        x = states[:, t]
        v = velocity(x, sigmas[t].expand(len(prompts)), **cond)
        mean, std = sde_mean_std(x, v, _bcast(sigmas[t], x), _bcast(sigmas[t + 1], x), noise_level, float(sigmas[1]))
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
