"""The FLUX.1 family against diffusers' `FluxPipeline` on tiny random models (`tiny:flux1`, dev-like:
a guidance embedding and dynamic shifting; and a schnell-like one built here, with neither): the same
initial latents, steps, embedded guidance and true_cfg_scale give the same timesteps, latents and
images, in float32 and in bfloat16 (tests/family_check.py: `assert_equals_pipeline`); the SDE's
log-probs are Normal's; the LoRA reference is the base; bfloat16 loads.

What jointrl does differently, none of which changes the result: it batches true guidance's two
branches in one forward pass (the pipeline makes two); its flow runs on the unpacked grid
(C, H/8, W/8), packed to the pipeline's 2x2 tokens inside the velocity (the pipeline holds packed
tokens through the loop and takes and returns its latents packed, which the test packs and
unpacks). The pipeline's negative prompt is always the empty one, passed to it once per prompt: a
single negative's embeddings would not batch with the latents.
"""
import pytest
import torch

from common.hub import local_model
from common.loading import DTYPES
from experts.flux1 import pack, unpack
from tests.family_check import (PROMPTS, assert_equals_pipeline, assert_loads_in_bfloat16, assert_logps_are_normal,
                                assert_lora_reference_is_base, family_config, parts, pipeline_sampled,
                                sampled_by_jointrl)

STEPS = 4
EMBEDDED_GUIDANCE = 3.5


def assert_pipeline_equal(path: str, guidance: float, dtype: str = "float32") -> None:
    """jointrl's ODE sampling of the model at `path` with true guidance `guidance` gives the pipeline's
    timesteps, latents and images."""
    from diffusers import FluxPipeline
    ours = sampled_by_jointrl(path, guidance, STEPS, f"experts.generator.model.embedded_guidance={EMBEDDED_GUIDANCE}",
                              dtype=dtype)
    size = ours.frontend.config.task.image_size
    pipe = FluxPipeline.from_pretrained(path, torch_dtype=DTYPES[dtype])
    negative = {"negative_prompt": [""] * len(PROMPTS)} if guidance > 1 else {}
    final, pixels, timesteps = pipeline_sampled(pipe, pack(ours.latents), prompt=PROMPTS, num_inference_steps=STEPS,
                                                guidance_scale=EMBEDDED_GUIDANCE, true_cfg_scale=guidance,
                                                max_sequence_length=16, height=size, width=size, **negative)
    assert_equals_pipeline(ours, ours.final, unpack(final, *ours.latents.shape[-2:]), pixels, timesteps, dtype, STEPS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_flux1_dev_ode_sampling_equals_the_diffusers_pipeline(guidance, dtype):
    assert_pipeline_equal(local_model("tiny:flux1"), guidance, dtype)


def test_flux1_schnell_ode_sampling_equals_the_diffusers_pipeline(tmp_path):
    """No guidance embedding (embedded_guidance unused) and a fixed shift, which ignores mu."""
    from experts.tiny.flux1 import tiny_flux1
    assert_pipeline_equal(str(tiny_flux1(tmp_path / "schnell", variant="schnell")), 1.0)


def test_pack_is_the_inverse_of_unpack():
    latents = torch.randn(2, 4, 6, 8)
    assert pack(latents).shape == (2, 12, 16)
    assert torch.equal(unpack(pack(latents), 6, 8), latents)


def test_flux1_sde_log_probs_are_normal_log_densities():
    velocity, frontend = parts(family_config(local_model("tiny:flux1"), "experts.generator.model.guidance_scale=3.0"))
    assert_logps_are_normal(velocity, frontend, PROMPTS, STEPS)


def test_lora_reference_is_the_base_transformer():
    wrapped = assert_lora_reference_is_base(local_model("tiny:flux1"), "experts.generator.model.guidance_scale=3.0")
    double = {f"transformer_blocks.0.{m}" for m in [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
        "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
        "ff_context.net.2"]}
    single = {f"single_transformer_blocks.0.attn.{m}" for m in ["to_q", "to_k", "to_v"]}
    assert wrapped == double | single


def test_flux1_loads_in_bfloat16():
    assert_loads_in_bfloat16(local_model("tiny:flux1"), "experts.generator.model.guidance_scale=3.0")
