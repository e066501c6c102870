"""The FLUX.1 family (`FluxPipeline`: FLUX.1-dev, FLUX.1-schnell): a double- then single-stream DiT on
tokens of the VAE's latents packed 2x2 (C, H/8, W/8 -> H/16 * W/16 tokens of 4C), placed by (0, h, w)
RoPE ids, the text's by zeros; CLIP's pooled embedding and T5's per-token embeddings, padded to
max_sequence_length; a FlowMatchEulerDiscreteScheduler. As diffusers' pipeline: sigmas
linspace(1, 1/N, N) shifted by mu = calculate_shift(image tokens) under dynamic shifting (dev; schnell's
scheduler shifts by its fixed shift), timestep = (sigma * 1000) / 1000, the distilled guidance
embedding read as embedded_guidance where the transformer has one (dev; schnell has none), true
classifier-free guidance against the empty prompt when guidance_scale (the pipeline's true_cfg_scale)
is > 1, latents decoded as z / scaling_factor + shift_factor.

jointrl's flow runs on the unpacked grid (C, H/8, W/8); the velocity packs and unpacks with the
pipeline's own functions.
"""
from __future__ import annotations

import torch

from experts.flow_family import FamilyFrontEnd, FamilyVelocity


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): the pipeline's 2x2 patches as tokens."""
    from diffusers import FluxPipeline
    return FluxPipeline._pack_latents(latents, *latents.shape)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack`, to (B, C, height, width)."""
    from diffusers import FluxPipeline
    return FluxPipeline._unpack_latents(tokens, height, width, vae_scale_factor=1)


class Velocity(FamilyVelocity):
    # Flow-GRPO's FLUX.1 targets (diffusers' DreamBooth LoRA script's): the joint attention's
    # projections of both streams (which also name the single blocks' q, k, v) and the double blocks' MLPs
    LORA_TARGETS = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                    "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                    "ff_context.net.2"]

    @staticmethod
    def conditioning(transformer: dict, model) -> tuple[dict, int]:
        """T5's tokens, CLIP's pooled embedding."""
        return {"prompt_embeds": ((model.max_sequence_length, transformer["joint_attention_dim"]), None),
                "pooled": ((transformer["pooled_projection_dim"],), None)}, model.max_sequence_length

    def velocity(self, x, sigma, cond) -> torch.Tensor:
        from diffusers import FluxPipeline
        dtype = self.transformer.dtype
        batch, _, height, width = x.shape
        embeds = cond["prompt_embeds"].to(dtype)
        guidance = torch.full((batch,), self.spec.embedded_guidance, device=x.device) \
            if self.transformer.config.guidance_embeds else None
        out = self.transformer(hidden_states=pack(x).to(dtype), encoder_hidden_states=embeds,
                               pooled_projections=cond["pooled"].to(dtype),
                               timestep=(sigma * 1000.0).to(dtype) / 1000,  # the scheduler's t, over 1000
                               guidance=guidance, txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=dtype),
                               img_ids=FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, x.device,
                                                                              dtype)).sample
        return unpack(out.float(), height, width)


class FrontEnd(FamilyFrontEnd):
    COMPONENTS = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")

    def __init__(self, config, device: torch.device):
        from diffusers import FluxPipeline
        super().__init__(config, device)
        self.pipeline = FluxPipeline(transformer=None, **self.parts)

    def latent_grid(self, image_size: int) -> tuple[int, ...]:
        # the pipeline's latent side: 2 * (size // (2 * vae_scale_factor)), even for the 2x2 packing
        side = 2 * self.check_side(2 * 2 ** (len(self.vae.config.block_out_channels) - 1))
        return self.vae.config.latent_channels, side, side

    def encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.pipeline.encode_prompt(prompt=texts, prompt_2=None, device=self.device,
                                                        max_sequence_length=self.spec.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled": pooled}

    def sigmas(self, steps: int) -> torch.Tensor:
        _, height, width = self.latent_shape
        return self.token_shifted_sigmas(steps, (height // 2) * (width // 2))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        scaled = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return self.vae.decode(scaled.to(self.vae.dtype)).sample.float().clamp(-1, 1)
