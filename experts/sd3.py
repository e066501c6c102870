"""The SD3 family (`StableDiffusion3Pipeline`: SD3, SD3.5): an MMDiT on VAE latents (C, H/8, W/8),
CLIP-L and CLIP-G (pooled and per token) and T5 text encoders, a FlowMatchEulerDiscreteScheduler
with a fixed shift. As diffusers' pipeline: timestep = sigma * 1000 (SD3's num_train_timesteps) in
float32 whatever the model's dtype (the pipeline passes the scheduler's timesteps as they are),
guidance against the empty prompt, latents decoded as z / scaling_factor + shift_factor.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from experts.flow_family import FamilyFrontEnd, FamilyVelocity


class Velocity(FamilyVelocity):
    @staticmethod
    def conditioning(transformer: dict, model) -> tuple[dict, int]:
        """CLIP-L and CLIP-G's 77 tokens beside T5's, joint_attention_dim wide; the pooled CLIPs."""
        tokens = 77 + model.max_sequence_length
        return {"prompt_embeds": ((tokens, transformer["joint_attention_dim"]), None),
                "pooled": ((transformer["pooled_projection_dim"],), None)}, tokens

    def velocity(self, x, sigma, cond) -> torch.Tensor:
        dtype = self.transformer.dtype
        out = self.transformer(hidden_states=x.to(dtype), timestep=sigma.float() * 1000.0,  # the pipeline's t
                               encoder_hidden_states=cond["prompt_embeds"].to(dtype),
                               pooled_projections=cond["pooled"].to(dtype)).sample
        return out.float()


class FrontEnd(FamilyFrontEnd):
    COMPONENTS = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3",
                  "tokenizer_3")

    def __init__(self, config, device: torch.device):
        from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
        super().__init__(config, device)
        self.pipeline = StableDiffusion3Pipeline(transformer=None, **self.parts)
        # the pipeline's prompt encoding reads the transformer's config (the width of the zeros that
        # stand in for T5 when a model has none); the worker's transformer is the synced expert's
        config = SD3Transformer2DModel.load_config(self.path, subfolder="transformer")
        self.pipeline.transformer = SimpleNamespace(config=SimpleNamespace(**config))

    def latent_grid(self, image_size: int) -> tuple[int, ...]:
        side = self.check_side(2 ** (len(self.vae.config.block_out_channels) - 1))
        return self.vae.config.latent_channels, side, side

    def encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=texts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.spec.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled": pooled}

    def sigmas(self, steps: int) -> torch.Tensor:
        return self.scheduler_sigmas(steps)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        scaled = latents / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
        return self.vae.decode(scaled.to(self.vae.dtype)).sample.float().clamp(-1, 1)
