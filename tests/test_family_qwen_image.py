"""The Qwen-Image family against diffusers' `QwenImagePipeline` on a tiny random model
(`tiny:qwen_image`): the same initial latents, steps and true_cfg_scale give the same timesteps,
latents and images, in float32 and in bfloat16 (tests/family_check.py: `assert_equals_pipeline`); the
SDE's log-probs are Normal's; the LoRA reference is the base; bfloat16 loads.

What jointrl does differently, none of which changes the result: it keeps each prompt's embeddings
at their own length and pads a batch to its longest with a mask of the real tokens, as the pipeline
does (which drops the mask when nothing is padded), and pads again where batches are joined (the
update's shards; the guidance's two branches, which it batches in one forward pass where the
pipeline makes two), checked below to leave the velocity unchanged; its flow runs on the unpacked
grid (C, H/8, W/8), packed to the pipeline's 2x2 tokens inside the velocity, where the guidance's
norm rescaling is computed per packed token as the pipeline's. The empty negative prompt is passed
to the pipeline once per prompt: a single negative's embeddings would not batch with the latents.
"""
import pytest
import torch

from common.hub import local_model
from common.loading import DTYPES
from experts.qwen_image import Velocity, pack, unpack
from tests.family_check import (PROMPTS, assert_close, assert_equals_pipeline, assert_loads_in_bfloat16,
                                assert_logps_are_normal, assert_lora_reference_is_base, family_config,
                                initial_latents, parts, pipeline_sampled, sampled_by_jointrl)

STEPS = 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_qwen_image_ode_sampling_equals_the_diffusers_pipeline(guidance, dtype):
    from diffusers import QwenImagePipeline
    path = local_model("tiny:qwen_image")
    ours = sampled_by_jointrl(path, guidance, STEPS, dtype=dtype)
    size = ours.frontend.config.task.image_size
    negative = {"negative_prompt": [""] * len(PROMPTS)} if guidance > 1 else {}
    pipe = QwenImagePipeline.from_pretrained(path, torch_dtype=DTYPES[dtype])
    final, pixels, timesteps = pipeline_sampled(pipe, pack(ours.latents), prompt=PROMPTS, num_inference_steps=STEPS,
                                                true_cfg_scale=guidance, max_sequence_length=16, height=size,
                                                width=size, **negative)
    assert_equals_pipeline(ours, ours.final, unpack(final, *ours.latents.shape[-2:]), pixels, timesteps, dtype, STEPS)


@torch.no_grad()
def test_text_padded_to_the_longest_prompt_leaves_the_velocity_unchanged():
    """Each prompt alone, unpadded as the pipeline encodes it, against the front end's batch (padded to
    its longest prompt) and against two batches joined as the update joins shards (padded again)."""
    path = local_model("tiny:qwen_image")
    velocity, frontend = parts(family_config(path, "experts.generator.model.max_sequence_length=64"))
    lengths = [len(f["prompt_embeds"]) for f in frontend.features(PROMPTS)]
    assert len(set(lengths)) == len(PROMPTS) and max(lengths) < 64  # each its own length
    batch = frontend.encode(PROMPTS)
    assert batch["prompt_embeds"].shape[1] == max(lengths) and batch["prompt_embeds_mask"].sum(1).tolist() == lengths
    short = min(range(len(PROMPTS)), key=lengths.__getitem__)
    alone_batch = frontend.encode([PROMPTS[short]])
    assert alone_batch["prompt_embeds_mask"].all()
    joined = velocity.merge_conditions([alone_batch, batch])  # the short prompt's batch padded again
    assert joined["prompt_embeds"].shape[1] == max(lengths)
    x, sigma = initial_latents(frontend, 1), torch.tensor([0.6])
    for prompt, cond, row in [*[(p, batch, i) for i, p in enumerate(PROMPTS)], (PROMPTS[short], joined, 0)]:
        embeds, mask = frontend.pipeline.encode_prompt(prompt=[prompt], max_sequence_length=64)
        assert mask is None
        alone = velocity.velocity(x, sigma, {"prompt_embeds": embeds, "prompt_embeds_mask": None})
        ours = velocity.velocity(x, sigma, {k: v[row:row + 1] for k, v in cond.items()})
        assert_close(ours, alone, 1e-5, f"velocity of {prompt!r} padded to {cond['prompt_embeds'].shape[1]}")


def test_qwen_image_sde_log_probs_are_normal_log_densities():
    path = local_model("tiny:qwen_image")
    velocity, frontend = parts(family_config(path, "experts.generator.model.guidance_scale=4.0"))
    assert_logps_are_normal(velocity, frontend, PROMPTS, STEPS)


def test_lora_reference_is_the_base_transformer():
    wrapped = assert_lora_reference_is_base(local_model("tiny:qwen_image"), "experts.generator.model.guidance_scale=4.0")
    assert {t for t in Velocity.LORA_TARGETS for k in wrapped if k.endswith(f".{t}")} == set(Velocity.LORA_TARGETS)


def test_qwen_image_loads_in_bfloat16():
    assert_loads_in_bfloat16(local_model("tiny:qwen_image"), "experts.generator.model.guidance_scale=4.0")
