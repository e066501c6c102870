"""The Wan family against diffusers' `WanPipeline` on tiny random models (`tiny:wan2.1`, one
transformer; `tiny:wan2.2_a14b`, a high- and a low-noise transformer switched at boundary_ratio, each
with its own guidance; `tiny:wan2.2_ti2v`, Wan2.2's 48-channel VAE and a timestep per latent token):
the same initial latents, steps and guidance give the same timesteps, latents and decoded frames, in
float32 and in bfloat16 (tests/family_check.py: `assert_equals_pipeline`); the SDE's log-probs over
the video latent are Normal's; the LoRA targets exist in both transformers and the LoRA reference is
the base.

The Wan checkpoints ship a UniPC multistep scheduler; jointrl samples the flow with Euler steps
(Flow-GRPO's SDE and its ODE limit), taking the sigmas of diffusers' FlowMatchEulerDiscreteScheduler
with the checkpoint's flow_shift. So the pipeline is given that Euler scheduler, of the same shift
and num_train_timesteps, as the other families' pipelines run with theirs.

What jointrl does differently, none of which changes the result: it batches the guidance's two
branches in one forward pass (the pipeline makes two). The pipeline's output_type="latent" is the
normalised latents jointrl's flow runs on; its negative prompt is the empty one.
"""
import contextlib

import numpy as np
import pytest
import torch

from common.hub import local_model
from common.loading import DTYPES
from tasks.base import TextPrompt
from tests.family_check import (PROMPTS, Sampled, assert_close, assert_decodes_as_the_pipeline, assert_equals_pipeline,
                                assert_logps_are_normal, family_config, initial_latents, jointrl_ode, parts)

STEPS = 4
FRAMES, HEIGHT, WIDTH = 5, 32, 64  # 2 latent frames; a non-square frame as the Wan presets use
CLIP = [f"task.num_frames={FRAMES}", f"task.image_size={HEIGHT}", f"task.image_width={WIDTH}",
        f"reward.terms.image.per_frame={{frames: {FRAMES}, reduce: mean}}"]  # the shapes image term, on each frame


def wan_pipeline(path: str, dtype: str):
    """diffusers' WanPipeline of `path` as its Wan examples load it (the VAE in float32 whatever the
    transformer's dtype), with the Euler scheduler of its UniPC config's shift."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(path, vae=vae, torch_dtype=DTYPES[dtype])
    c = pipe.scheduler.config
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=c.num_train_timesteps, shift=c.flow_shift)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@contextlib.contextmanager
def timesteps_of(model):
    """The timesteps `model`'s transformers (`transformer`, `transformer_2`) are called with inside the
    block, in call order, one (transformer, dtype, value) per step: a call gives one timestep per
    sample, or per latent token (`expand_timesteps`), all the same value; the pipelines' two calls of
    a step under guidance (jointrl makes one) give the same."""
    seen = []
    names = [n for n in ("transformer", "transformer_2") if getattr(model, n, None) is not None]

    def recording(name, original):
        def forward(*args, **kwargs):
            t = kwargs["timestep"]
            assert t.dim() in (1, 2) and torch.equal(t, t.flatten()[:1].expand_as(t)), t
            entry = (name, t.dtype, float(t.flatten()[0]))
            if not seen or seen[-1] != entry:
                seen.append(entry)
            return original(*args, **kwargs)
        return forward

    for name in names:
        transformer = getattr(model, name)
        transformer.forward = recording(name, transformer.forward)
    try:
        yield seen
    finally:
        for name in names:
            del getattr(model, name).forward


def clip_sampled(pipe, latents, **call):
    """(the pipeline's final latents, its frames (B, F, 3, H, W) in [0, 1], its transformers' timesteps)."""
    call = dict(prompt=PROMPTS, num_inference_steps=STEPS, max_sequence_length=16, num_frames=FRAMES, height=HEIGHT,
                width=WIDTH, **call)
    with timesteps_of(pipe) as seen:
        final = pipe(latents=latents.clone(), output_type="latent", **call).frames
    return final, pipe(latents=latents.clone(), output_type="pt", **call).frames, seen


def by_jointrl(path: str, guidance: float, dtype: str, *extra: str) -> Sampled:
    """jointrl's deterministic sampling of the clip (initial latents representable in `dtype`), with
    every transformer's timesteps labelled as `clip_sampled` labels the pipeline's."""
    velocity, frontend = parts(family_config(path, *CLIP, f"experts.generator.model.guidance_scale={guidance}",
                                             f"experts.generator.model.dtype={dtype}", *extra))
    latents = initial_latents(frontend, len(PROMPTS)).to(DTYPES[dtype]).float()
    with timesteps_of(velocity) as timesteps:
        final, clip = jointrl_ode(velocity, frontend, PROMPTS, latents, STEPS)
    return Sampled(frontend, latents, final, clip, timesteps)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["wan2.1", "wan2.2_a14b"])
def test_wan_ode_sampling_equals_the_diffusers_pipeline(kind, dtype):
    path = local_model(f"tiny:{kind}")
    low_guidance = {"guidance_scale_2": 3.0} if kind == "wan2.2_a14b" else {}
    ours = by_jointrl(path, 5.0, dtype, *[f"experts.generator.model.{k}={v}" for k, v in low_guidance.items()])
    assert ours.latents.shape[1:] == (16, 2, HEIGHT // 8, WIDTH // 8)
    assert ours.frontend.vae.dtype == torch.float32  # as diffusers' examples, whatever the transformer's dtype
    assert ours.frontend.parts["text_encoder"].dtype == DTYPES[dtype]
    final, frames, timesteps = clip_sampled(wan_pipeline(path, dtype), ours.latents, guidance_scale=5.0, **low_guidance)
    assert ours.image.shape == (len(PROMPTS), FRAMES, 3, HEIGHT, WIDTH) == frames.shape
    if low_guidance:  # both transformers ran, each on its side of the boundary (0.875 x 1000)
        assert {n for n, *_ in timesteps} == {"transformer", "transformer_2"}
        assert all((t >= 875) == (n == "transformer") for n, _, t in timesteps)
    # the VAE decodes in float32 in both: the same latents give the same frames, in either dtype
    assert_decodes_as_the_pipeline(ours.frontend, final, frames)
    assert_equals_pipeline(ours, ours.final, final, frames, timesteps, dtype, STEPS, images=dtype == "float32")


def test_wan22_ti2v_timestep_per_token_and_48_channel_vae_equal_the_pipeline():
    """TI2V-5B's layout: the Wan2.2 VAE (16x spatial, 48 channels) and a timestep per latent token."""
    path = local_model("tiny:wan2.2_ti2v")
    ours = by_jointrl(path, 5.0, "float32")
    assert ours.latents.shape[1:] == (48, 2, HEIGHT // 16, WIDTH // 16)
    final, frames, timesteps = clip_sampled(wan_pipeline(path, "float32"), ours.latents, guidance_scale=5.0)
    assert_equals_pipeline(ours, ours.final, final, frames, timesteps, "float32", STEPS)


def test_wan_sde_log_probs_over_the_video_latent_are_normal_log_densities():
    velocity, frontend = parts(family_config(local_model("tiny:wan2.2_a14b"), *CLIP,
                                             "experts.generator.model.guidance_scale=5.0",
                                             "experts.generator.model.guidance_scale_2=3.0"))
    assert len(frontend.latent_shape) == 4
    assert_logps_are_normal(velocity, frontend, PROMPTS, STEPS)


def test_lora_targets_and_reference_in_both_transformers():
    """The adapter wraps the self- and cross-attention projections of every block of both
    transformers; with random adapter weights the velocity moves at both noise levels, and with the
    adapters disabled it is the base model's."""
    base, frontend = parts(family_config(local_model("tiny:wan2.2_a14b"), *CLIP))
    adapted, _ = parts(family_config(local_model("tiny:wan2.2_a14b"), *CLIP,
                                     "experts.generator.model.lora={r: 4, alpha: 8}"))
    synced = adapted.synced_state()
    assert synced and all("lora_" in k for k in synced)
    assert {k.split(".lora_")[0] for k in synced} == {
        f"{t}.blocks.{b}.{attn}.{proj}" for t in ("transformer", "transformer_2") for b in (0, 1)
        for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v", "to_out.0")}
    cond = frontend.condition([TextPrompt(p) for p in PROMPTS], [{} for _ in PROMPTS])
    x, sigma = initial_latents(frontend, len(PROMPTS)), torch.tensor([1.0, 0.5, 0.9])  # rows of both noise levels
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param))
        with adapted.adapter_disabled():
            reference = adapted(x, sigma, **cond)
        moved = adapted(x, sigma, **cond)
        assert_close(reference, base(x, sigma, **cond), 1e-6, "velocity with the adapters disabled")
    for row in range(len(PROMPTS)):
        assert not torch.allclose(moved[row], reference[row]), row


def test_the_update_on_video_latents_reaches_both_transformers():
    """Flow-GRPO's loss on 4-D latents per sample: a micro-batch mixing steps of both noise levels
    gives each transformer's adapter a gradient, and the trajectories travel as host arrays."""
    from algorithm.losses import GeneratorObjective, generator_backward
    from algorithm.sde import sample
    from experts.trajectories import split_shared, trajectories
    from experts.weights import reference_of
    velocity, frontend = parts(family_config(local_model("tiny:wan2.2_a14b"), *CLIP,
                                             "experts.generator.model.guidance_scale=5.0",
                                             "experts.generator.model.lora={r: 4, alpha: 8}"))
    cond = frontend.condition([TextPrompt(p) for p in PROMPTS], [{} for _ in PROMPTS])
    sigmas, sde = frontend.sigmas(STEPS), torch.ones(STEPS, dtype=torch.bool)
    noise = torch.randn((len(PROMPTS), STEPS + 1, *frontend.latent_shape), generator=torch.Generator().manual_seed(2))
    states, logps = sample(lambda x, s: velocity(x, s, **cond), noise, sigmas, 0.7, sde=sde)
    per_sample, shared = split_shared(cond)
    travelled = trajectories(states, torch.arange(STEPS + 1), logps, per_sample, shared_cond=shared, sigmas=sigmas,
                             sde=sde)
    assert travelled.states.shape == (len(PROMPTS), STEPS + 1, *frontend.latent_shape)
    batch = {"states": states, "state_steps": torch.arange(STEPS + 1), "logps": logps, "sigmas": sigmas, "sde": sde,
             "cond": per_sample, "shared_cond": shared}
    generator_backward(velocity.train(), reference_of(velocity), batch, torch.tensor([1.0, -1.0, 0.5]),
                       obj=GeneratorObjective(0.7, 1e-4, 0.01, "exact", True, 2 * STEPS))
    grads = {t: sum(float(p.grad.abs().sum()) for n, p in velocity.named_parameters()
                    if n.startswith(f"{t}.") and p.grad is not None) for t in ("transformer", "transformer_2")}
    assert all(g > 0 for g in grads.values()), grads


@pytest.mark.parametrize("sets, named", [
    (["experts.generator.model={kind: diffusers_flow, path: 'tiny:wan2.1'}", "task.num_frames=6"],
     ["task.num_frames=6", "4k+1", "5, 9, 13", "nearest 5 or 9"]),
    (["experts.generator.model={kind: diffusers_flow, path: 'tiny:wan2.1'}"], ["task.num_frames is not set", "4k+1"]),
    (["experts.generator.model={kind: diffusers_flow, path: 'tiny:wan2.2_ti2v'}", "task.num_frames=5",
      "task.image_width=48"], ["task.image_width=48", "multiple of 32"]),
    (["experts.generator.model={kind: diffusers_flow, path: 'tiny:sd3'}", "task.num_frames=5"],
     ["task.num_frames=5", "image model (StableDiffusion3Pipeline)", "WanPipeline"]),
    (["experts.generator.model={kind: diffusers_flow, path: 'tiny:sd3'}", "task.image_width=64"],
     ["task.image_width=64", "square"]),
    (["task.image_width=64"], ["task.image_width=64", "square"]),
    (["experts.generator.model={kind: diffusers_flow, path: 'tiny:wan2.1', guidance_scale_2: 3.0}",
      "task.num_frames=5"],
     ["experts.generator.model.guidance_scale_2=3.0", "no low-noise transformer"]),
])
def test_a_clip_the_generator_cannot_make_exits_2_naming_the_key(sets, named, monkeypatch, tmp_path, capsys):
    import driver.cli as cli
    monkeypatch.setattr(cli, "train", lambda *_: pytest.fail("training started for a bad config"))
    args = [a for s in sets for a in ("--set", s)]
    assert cli.main(["train", "--config", "shapes-tiny", *args, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in named), err


def clip_brightness(images, prompts, refinements):
    """A reward on clips for the rollout below: each clip's mean brightness; it refuses anything but a
    batch of this file's clips (B, F, 3, H, W)."""
    images = np.asarray(images)
    if images.shape[1:] != (FRAMES, 3, HEIGHT, WIDTH):
        raise ValueError(f"not a batch of clips: {images.shape}")
    return images.mean(axis=(1, 2, 3, 4))


def test_a_wan_generator_rolls_out_clips_and_learns_from_them():
    """A rollout worker and the generator expert in-process, tiny:wan2.1: the reward receives clips
    (B, F, 3, H, W), the trajectories hold the latent video (B, S, C, F', H', W'), and an update from
    them moves the LoRA adapter, whose new version the worker serves."""
    from algorithm.batch import Sample
    from cluster.expert_actor import ExpertActor
    from cluster.rollout_worker import RolloutWorker
    from tasks.shapes import prompt_set
    from tests.conftest import make_config
    cfg = make_config(f"experts.generator.model={{kind: diffusers_flow, path: 'tiny:wan2.1', max_sequence_length: 16, "
                      f"lora: {{r: 4, alpha: 8}}}}", *CLIP, "experts.n_refiners=1",
                      "reward.terms={clip: {fn: 'tests.test_wan:clip_brightness'}}", "experts.generator.lr=0.01",
                      "experts.generator.sample_steps=2", preset="shapes-tiny")
    worker = RolloutWorker(cfg, 0)
    experts = {e: ExpertActor(cfg, e) for e in cfg.experts.ids()}
    for e, actor in experts.items():
        worker.load_weights(e, 0, actor.weights())
    items = [Sample(k, 0, prompt_set(1, seed=0)[0], k < 3) for k in range(4)]
    meta, traj, _ = worker.run(0, items)
    assert meta.valid.all() and np.isfinite(meta.terms["clip"]).all(), meta.faults
    assert traj.states.shape[0] == len(items) and traj.states.shape[2:] == (16, 2, HEIGHT // 8, WIDTH // 8)
    generator = experts["generator"]
    before = {k: np.array(v, copy=True) for k, v in generator.weights().items()}
    stats = generator.update(0, 0, np.linspace(-1, 1, len(items)), traj)
    assert stats["version"] == 1 and np.isfinite(stats["loss"])
    after = generator.weights()
    assert any(not np.array_equal(before[k], after[k]) for k in before if "lora_B" in k)
    worker.load_weights("generator", 1, after)
    assert worker.run(1, items).meta.versions[0]["generator"] == 1
