"""The FLUX.2 klein family (`Flux2KleinPipeline`): a double- then single-stream DiT on tokens of the
VAE's 2x2-patchified latents (4C, H/16, W/16), each token one cell, placed by (t, h, w, l) RoPE ids;
a Qwen3 text encoder read through its chat template (thinking off), the hidden states of layers 9,
18 and 27 side by side per token, padded to max_sequence_length; a FlowMatchEulerDiscreteScheduler
with dynamic shifting. As diffusers' pipeline: sigmas linspace(1, 1/N, N) shifted by
mu = compute_empirical_mu(image tokens, N), timestep = (sigma * 1000) / 1000, true classifier-free
guidance against the empty prompt (guidance_scale; none for a step-distilled model, which the
pipeline runs unguided), no guidance embedding (embedded_guidance is unused); latents decoded by
undoing the VAE's batch-norm normalisation, unpatchifying and decoding.

jointrl's flow runs on the pipeline's noise space, the normalised patchified grid (4C, H/16, W/16)
before its packing into tokens; the velocity packs and unpacks.
"""
from __future__ import annotations

import numpy as np
import torch

from experts.flow_family import FamilyFrontEnd, FamilyVelocity


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H * W, C): each cell a token, row-major, as the pipeline packs."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack`, to (B, C, height, width)."""
    return tokens.permute(0, 2, 1).reshape(tokens.shape[0], tokens.shape[2], height, width)


class Velocity(FamilyVelocity):
    # diffusers' FLUX.2 klein LoRA script: the double blocks' image attention and the single blocks'
    # fused projections; a regex (peft matches it whole), as a suffix "to_out" would also name the
    # double blocks' to_out ModuleList
    LORA_TARGETS = (r"(transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)"
                    r"|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out))")

    @staticmethod
    def conditioning(transformer: dict, model) -> tuple[dict, int]:
        """Three Qwen3 layers side by side per token (joint_attention_dim)."""
        return {"prompt_embeds": ((model.max_sequence_length, transformer["joint_attention_dim"]), None)}, \
            model.max_sequence_length

    def velocity(self, x, sigma, cond) -> torch.Tensor:
        from diffusers import Flux2KleinPipeline
        dtype = self.transformer.dtype
        embeds = cond["prompt_embeds"].to(dtype)
        out = self.transformer(hidden_states=pack(x).to(dtype), encoder_hidden_states=embeds,
                               timestep=(sigma * 1000.0).to(dtype) / 1000,  # the scheduler's t, over 1000
                               img_ids=Flux2KleinPipeline._prepare_latent_ids(x).to(x.device),
                               txt_ids=Flux2KleinPipeline._prepare_text_ids(embeds).to(x.device),
                               guidance=None).sample
        return unpack(out.float(), *x.shape[-2:])


class FrontEnd(FamilyFrontEnd):
    COMPONENTS = ("scheduler", "vae", "text_encoder", "tokenizer")

    def __init__(self, config, device: torch.device):
        from diffusers import Flux2KleinPipeline
        super().__init__(config, device)
        if self.index.get("is_distilled") and self.spec.guidance_scale != 1.0:
            raise ValueError(f"experts.generator.model.path={self.spec.path} is a step-distilled FLUX.2 klein, "
                             f"which its pipeline samples without guidance; set guidance_scale=1")
        self.pipeline = Flux2KleinPipeline(transformer=None, **self.parts)

    def latent_grid(self, image_size: int) -> tuple[int, ...]:
        c = self.vae.config
        side = self.check_side(2 * 2 ** (len(c.block_out_channels) - 1))  # a 2x2 patch of VAE cells
        return c.latent_channels * int(np.prod(c.patch_size)), side, side

    def encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipeline.encode_prompt(prompt=texts, device=self.device,
                                                max_sequence_length=self.spec.max_sequence_length)
        return {"prompt_embeds": embeds}

    def sigmas(self, steps: int) -> torch.Tensor:
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
        _, height, width = self.latent_shape
        return self.scheduler_sigmas(steps, sigmas=np.linspace(1.0, 1 / steps, steps),
                                     mu=compute_empirical_mu(image_seq_len=height * width, num_steps=steps))

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents (B, C, H/8, W/8) of latents on the flow's grid: batch norm undone, unpatchified
        (the pipeline's output_type="latent")."""
        from diffusers import Flux2KleinPipeline
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(latents.device,
                                                                                                  latents.dtype)
        return Flux2KleinPipeline._unpatchify_latents(latents * std + mean)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(self.vae_latents(latents).to(self.vae.dtype)).sample.float().clamp(-1, 1)
