"""The FLUX.2 klein family against diffusers' `Flux2KleinPipeline` on a tiny random model
(`tiny:flux2_klein`): the same initial latents, steps and guidance_scale give the same timesteps,
latents and images, in float32 and in bfloat16 (tests/family_check.py: `assert_equals_pipeline`); the
SDE's log-probs are Normal's; the LoRA reference is the base; bfloat16 loads; a
step-distilled model refuses guidance, which its pipeline would ignore.

What jointrl does differently, none of which changes the result: it batches the guidance's two
branches in one forward pass (the pipeline makes two); its flow runs on the pipeline's noise space,
the batch-normalised 2x2-patchified grid, which it packs into tokens inside the velocity (the
pipeline holds packed tokens through the loop and unpacks them once at the end). The pipeline takes
its initial latents on that same grid, and its output_type="latent" is the VAE's latents, which the
front end's `vae_latents` gives of ours. The pipeline's negative prompt is always the empty one.
"""
import json
import shutil

import pytest

from common.hub import local_model
from common.loading import DTYPES, ModelLoadError
from tests.family_check import (PROMPTS, assert_equals_pipeline, assert_loads_in_bfloat16, assert_logps_are_normal,
                                assert_lora_reference_is_base, family_config, parts, pipeline_sampled,
                                sampled_by_jointrl)

STEPS = 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_flux2_klein_ode_sampling_equals_the_diffusers_pipeline(guidance, dtype):
    from diffusers import Flux2KleinPipeline
    path = local_model("tiny:flux2_klein")
    ours = sampled_by_jointrl(path, guidance, STEPS, dtype=dtype)
    size = ours.frontend.config.task.image_size
    pipe = Flux2KleinPipeline.from_pretrained(path, torch_dtype=DTYPES[dtype])
    final, pixels, timesteps = pipeline_sampled(pipe, ours.latents, prompt=PROMPTS, num_inference_steps=STEPS,
                                                guidance_scale=guidance, max_sequence_length=16, height=size,
                                                width=size)
    assert_equals_pipeline(ours, ours.frontend.vae_latents(ours.final), final, pixels, timesteps, dtype, STEPS)


def test_flux2_klein_sde_log_probs_are_normal_log_densities():
    velocity, frontend = parts(family_config(local_model("tiny:flux2_klein"),
                                             "experts.generator.model.guidance_scale=4.0"))
    assert_logps_are_normal(velocity, frontend, PROMPTS, STEPS)


def test_lora_reference_is_the_base_transformer():
    wrapped = assert_lora_reference_is_base(local_model("tiny:flux2_klein"), "experts.generator.model.guidance_scale=4.0")
    assert wrapped == {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                       "transformer_blocks.0.attn.to_v", "transformer_blocks.0.attn.to_out.0",
                       "single_transformer_blocks.0.attn.to_qkv_mlp_proj", "single_transformer_blocks.0.attn.to_out"}


def test_flux2_klein_loads_in_bfloat16():
    assert_loads_in_bfloat16(local_model("tiny:flux2_klein"), "experts.generator.model.guidance_scale=4.0")


def test_a_step_distilled_model_refuses_guidance(tmp_path):
    from experts.frontend import build_frontend
    distilled = tmp_path / "klein-distilled"
    shutil.copytree(local_model("tiny:flux2_klein"), distilled)
    index = json.loads((distilled / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    with pytest.raises(ModelLoadError, match="step-distilled") as refused:  # the user's to fix: exit 2
        build_frontend(family_config(str(distilled), "experts.generator.model.guidance_scale=4.0"))
    assert refused.value.config_key == "experts.generator.model.path"
    build_frontend(family_config(str(distilled)))
