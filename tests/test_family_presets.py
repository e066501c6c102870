"""The per-family presets carry their peer's published settings (each value cited in the preset),
and the SD3.5 preset's KL term is Flow-GRPO's on the same tensors."""
import pytest
import torch

from common.hub import local_model
from driver.config import resolve_config
from tests.family_check import PROMPTS, family_config, parts

PUBLISHED = {  # preset -> dotted key -> value (Flow-GRPO config/grpo.py; PromptRL's launch scripts)
    "sd3": {"experts.generator.model.path": "stabilityai/stable-diffusion-3.5-medium", "task.image_size": 512,
            "experts.generator.sample_steps": 10, "experts.generator.model.guidance_scale": 4.5,
            "experts.generator.noise_level": 0.7, "experts.generator.kl_beta": 0.01,
            "experts.generator.kl_form": "flow_grpo", "experts.generator.lr": 3e-4, "experts.generator.clip_eps": 1e-4,
            "experts.generator.train_final_step": False, "algorithm.group_size": 24, "algorithm.adv_std": "batch",
            "algorithm.adv_clip": 5.0, "experts.generator.model.lora.r": 32, "experts.generator.model.lora.alpha": 64,
            "experts.generator.model.max_sequence_length": 128},
    "flux1": {"experts.generator.model.path": "black-forest-labs/FLUX.1-dev", "experts.generator.sample_steps": 6,
              "experts.generator.model.embedded_guidance": 3.5, "experts.generator.model.guidance_scale": 1.0,
              "experts.generator.noise_level": 0.9, "experts.generator.kl_beta": 0.0,
              "experts.generator.train_final_step": False, "algorithm.group_size": 24, "algorithm.adv_std": "batch",
              "experts.generator.model.lora.r": 64, "experts.generator.model.lora.alpha": 128},
    "qwen-image": {"experts.generator.model.path": "Qwen/Qwen-Image", "experts.generator.sample_steps": 10,
                   "experts.generator.model.guidance_scale": 4.0, "experts.generator.noise_level": 1.2,
                   "experts.generator.sde_window": [0, 2], "experts.generator.kl_beta": 0.0,
                   "algorithm.group_size": 16, "algorithm.adv_std": "batch", "experts.generator.model.lora.r": 64},
    "flux2-klein": {"experts.generator.sample_steps": 20, "experts.generator.sde_window": [0, 8],
                    "experts.generator.model.guidance_scale": 4.0, "experts.generator.noise_level": 0.8,
                    "experts.generator.lr": 2e-7, "experts.generator.kl_beta": 0.01,
                    "experts.generator.kl_form": "flow_grpo", "experts.generator.model.lora": None,
                    "algorithm.group_size": 8, "algorithm.num_skip_refinement": 2, "task.image_size": 1024,
                    "experts.refiners.0.lr": 1e-6, "experts.refiners.0.kl_beta": 0.01},
    "wan2.1-1.3b": {"experts.generator.model.path": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "task.num_frames": 33,
                    "task.image_size": 240, "task.image_width": 416, "experts.generator.sample_steps": 20,
                    "experts.generator.model.guidance_scale": 4.5, "experts.generator.kl_beta": 0.004,
                    "experts.generator.lr": 1e-4, "experts.generator.clip_eps": 1e-3, "algorithm.group_size": 4,
                    "experts.generator.train_final_step": False, "experts.generator.model.lora.r": 32,
                    "experts.generator.model.lora.alpha": 64, "experts.generator.model.max_sequence_length": 512},
    "wan2.2-a14b": {"experts.generator.model.path": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "task.num_frames": 5,
                    "task.image_size": 480, "experts.generator.sample_steps": 10,
                    "experts.generator.model.guidance_scale": 4.0, "experts.generator.model.guidance_scale_2": 3.0,
                    "experts.generator.noise_level": 0.9, "experts.generator.lr": 1e-4,
                    "experts.generator.clip_eps": 1e-4, "experts.generator.kl_beta": 0.0, "algorithm.group_size": 16,
                    "algorithm.adv_clip": 5.0, "experts.generator.model.lora.r": 64,
                    "experts.generator.model.lora.alpha": 128, "experts.generator_low.lr": 1e-4,
                    "experts.generator_low.model.lora.r": 64},
    "wan-promptrl": {"experts.generator.model.path": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "experts.n_refiners": 1,
                     "algorithm.group_size": 8, "algorithm.num_skip_refinement": 2, "task.num_frames": 81},
}


def value(config, key: str):
    node = config
    for part in key.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


@pytest.mark.parametrize("preset", PUBLISHED)
def test_a_family_preset_holds_its_peers_published_values(preset):
    config = resolve_config(preset)
    for key, expected in PUBLISHED[preset].items():
        assert value(config, key) == expected, (preset, key, value(config, key))


def test_every_preset_claiming_flow_grpo_uses_its_kl_form():
    for preset in ("gpu", "geneval", "pickscore", "ocr", "sd3", "flux1", "qwen-image", "flux2-klein", "wan2.1-1.3b"):
        assert resolve_config(preset).experts.generator.kl_form == "flow_grpo", preset


def flow_grpo_kl(x, v, v_ref, sigmas, t, noise_level):
    """Flow-GRPO's KL term of timestep t as its code writes it (scripts/train_sd3.py; the step from
    diffusers_patch/sd3_sde_with_logprob.py): ((mean - mean_ref)^2).mean(dims) / (2 std_dev_t^2), batch mean."""
    sigma, sigma_prev = sigmas[t], sigmas[t + 1]
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma))) * noise_level

    def mean(vel):
        return x * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + vel * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt

    return (((mean(v) - mean(v_ref)) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t ** 2)).mean()


def test_the_sd3_presets_kl_term_is_flow_grpos_on_the_same_tensors():
    """The sd3 preset's settings (10 steps, guidance 4.5, noise 0.7, all steps but the last, kl_form
    flow_grpo) on a tiny SD3 with a moved LoRA adapter: jointrl's KL statistic equals the mean over
    trained timesteps of Flow-GRPO's per-timestep KL term."""
    from algorithm.losses import GeneratorObjective, generator_backward
    from algorithm.sde import sample
    from experts.trajectories import split_shared
    from experts.weights import reference_of
    from tasks.base import TextPrompt
    preset = resolve_config("sd3").experts.generator
    config = family_config(local_model("tiny:sd3"), f"experts.generator.model.guidance_scale={preset.model.guidance_scale}",
                           "experts.generator.model.lora={r: 4, alpha: 8}")
    velocity, frontend = parts(config)
    with torch.no_grad():
        for name, p in velocity.named_parameters():
            if "lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    cond = frontend.condition([TextPrompt(p) for p in PROMPTS], [{} for _ in PROMPTS])
    steps = preset.sample_steps
    sigmas = frontend.sigmas(steps)
    noise = torch.randn((len(PROMPTS), steps + 1, *frontend.latent_shape), generator=torch.Generator().manual_seed(2))
    states, logps = sample(lambda x, s: velocity(x, s, **cond), noise, sigmas, preset.noise_level,
                           sde=torch.ones(steps, dtype=torch.bool))
    per_sample, shared = split_shared(cond)
    batch = {"states": states, "state_steps": torch.arange(steps + 1), "logps": logps, "sigmas": sigmas,
             "sde": torch.ones(steps, dtype=torch.bool), "cond": per_sample, "shared_cond": shared}
    reference = reference_of(velocity)
    _, stats = generator_backward(velocity, reference, batch, torch.zeros(len(PROMPTS)), obj=GeneratorObjective(
        preset.noise_level, preset.clip_eps, preset.kl_beta, preset.kl_form, preset.train_final_step))
    with torch.no_grad():
        theirs = [flow_grpo_kl(states[:, t], velocity(states[:, t], sigmas[t].expand(3), **cond),
                               reference(states[:, t], sigmas[t].expand(3), **cond), sigmas, t, preset.noise_level)
                  for t in range(steps - 1)]  # timestep_fraction 0.99: all but the last
    expected = float(torch.stack(theirs).mean())
    assert expected > 0 and abs(stats["kl"] - expected) <= 1e-5 * expected, (stats["kl"], expected)
