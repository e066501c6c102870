"""The SD3 family against diffusers' `StableDiffusion3Pipeline` on a tiny random model (`tiny:sd3`):
the same initial latents, steps and guidance give the same timesteps, latents and images, in float32
and in bfloat16 (tests/family_check.py: `assert_equals_pipeline`); the SDE's log-probs are Normal's.
Nothing the pipeline does is left out here: jointrl batches the guidance's two branches in one
forward pass, as the pipeline does."""
import pytest
import torch

from common.hub import local_model
from common.loading import DTYPES
from tests.family_check import (PROMPTS, assert_close, assert_equals_pipeline, assert_loads_in_bfloat16,
                                assert_logps_are_normal, assert_lora_reference_is_base, family_config, parts,
                                pipeline_sampled, sampled_by_jointrl)

STEPS = 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_sd3_ode_sampling_equals_the_diffusers_pipeline(guidance, dtype):
    from diffusers import StableDiffusion3Pipeline
    path = local_model("tiny:sd3")
    ours = sampled_by_jointrl(path, guidance, STEPS, dtype=dtype)
    pipe = StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None, image_encoder=None,
                                                    feature_extractor=None, torch_dtype=DTYPES[dtype])
    size = ours.frontend.config.task.image_size
    final, pixels, timesteps = pipeline_sampled(pipe, ours.latents, prompt=PROMPTS, num_inference_steps=STEPS,
                                                guidance_scale=guidance, max_sequence_length=16, height=size,
                                                width=size)
    assert_equals_pipeline(ours, ours.final, final, pixels, timesteps, dtype, STEPS)


def test_sd3_sde_log_probs_are_normal_log_densities():
    velocity, frontend = parts(family_config(local_model("tiny:sd3"), "experts.generator.model.guidance_scale=2.0"))
    assert_logps_are_normal(velocity, frontend, PROMPTS, STEPS)


def test_train_cfg_false_updates_the_conditional_velocity_alone():
    """experts.generator.train_cfg=false: the update's batch carries no empty-prompt conditioning,
    so the velocity it trains is the conditional one, though sampling was guided."""
    from experts.kinds import expert_kind
    from experts.trajectories import split_shared, trajectories
    from tasks.base import TextPrompt
    config = family_config(local_model("tiny:sd3"), "experts.generator.model.guidance_scale=3.0",
                           "experts.generator.train_cfg=false")
    velocity, frontend = parts(config)
    cond = frontend.condition([TextPrompt(p) for p in PROMPTS], [{} for _ in PROMPTS])
    assert any(k.startswith("negative_") for k in cond)
    positive, negative = split_shared(cond)
    shard = trajectories(torch.zeros(3, STEPS + 1, *frontend.latent_shape), torch.arange(STEPS + 1),
                         torch.zeros(3, STEPS), positive, shared_cond=negative, sigmas=frontend.sigmas(STEPS),
                         sde=torch.ones(STEPS, dtype=torch.bool))
    merged = expert_kind(config, "generator").merge(velocity, [shard], torch.device("cpu"))
    assert set(merged["cond"]) == set(positive) and merged["shared_cond"] == {}
    x, sigma = torch.randn(3, *frontend.latent_shape), torch.full((3,), 0.5)
    with torch.no_grad():
        conditional = velocity.velocity(x, sigma, merged["cond"])
        assert torch.equal(velocity(x, sigma, **merged["cond"]), conditional)
        assert not torch.allclose(velocity(x, sigma, **cond), conditional)


def test_lora_reference_is_the_base_transformer():
    wrapped = assert_lora_reference_is_base(local_model("tiny:sd3"), "experts.generator.model.guidance_scale=3.0")
    assert {k.split(".attn.")[-1] for k in wrapped} == {"to_q", "to_k", "to_v", "to_out.0"}


def test_sd3_loads_in_bfloat16():
    assert_loads_in_bfloat16(local_model("tiny:sd3"), "experts.generator.model.guidance_scale=3.0")


@torch.no_grad()
def test_the_text_cache_stays_within_its_bound_in_the_encoders_dtype():
    """rollout.text_cache_mb: over 300 unique refined prompts (each batch repeating two of the last),
    the front end's cache never holds more bytes than its bound and serves the features encoded
    without a cache; its entries keep the text encoders' dtype (bfloat16: half of float32's bytes)."""
    from experts.frontend import build_frontend
    from experts.text_encoder import held_bytes
    path = local_model("tiny:sd3")
    cached = build_frontend(family_config(path, "rollout.text_cache_mb=0.25"))
    uncached = build_frontend(family_config(path, "rollout.text_cache_mb=0"))
    bound = cached.cache.max_bytes
    texts = [f"{PROMPTS[i % 3]}, refined {i}" for i in range(300)]
    for first in range(0, 300, 20):
        batch = texts[first:first + 20] + texts[max(0, first - 2):first]
        ours, want = cached.encode(batch), uncached.encode(batch)
        for k, v in want.items():
            assert_close(ours[k], v, 1e-6, k)
        assert cached.cache.bytes == sum(held_bytes(f) for f in cached.cache.entries.values()) <= bound
    assert cached.take_stats() == (14 * 2, 300) and len(uncached.cache) == 0
    assert 20 < len(cached.cache) < 300 and list(cached.cache.entries) == texts[-len(cached.cache):]
    entry = cached.cache.get(texts[-1])
    half = build_frontend(family_config(path, "experts.generator.model.dtype=bfloat16"))
    half.encode(texts[-1:])
    assert {f.dtype for f in half.cache.get(texts[-1]).values()} == {torch.bfloat16}
    assert 2 * half.cache.bytes == held_bytes(entry)
