"""The Qwen-Image family (`QwenImagePipeline`): an MMDiT on 2x2-packed tokens of a causal 3-D VAE's
latents (B, C, 1, H/8, W/8), a Qwen2.5-VL text encoder read through a chat template whose system turn
is dropped, and a FlowMatchEulerDiscreteScheduler with dynamic (sequence-length) shifting. As diffusers'
pipeline: sigmas linspace(1, 1/N, N) shifted by mu = calculate_shift(image tokens), timestep = the
scheduler's t = sigma * 1000 cast to the model's dtype, then divided by 1000 (in bf16: not bf16(sigma)),
true classifier-free guidance whose combination is rescaled, token by token, to the conditional
prediction's norm, latents decoded as z * latents_std + latents_mean.

jointrl's flow runs on the unpacked grid (C, H/8, W/8) without the frame axis; the velocity packs and
unpacks. Each text keeps its own length (at most max_sequence_length tokens) in the cache; a batch
pads its embeddings with zeros to its longest prompt, as the pipeline does, with a mask of the real
tokens (which the pipeline drops when nothing is padded): the transformer masks padded text tokens
out of attention and places text RoPE by index, so the padding leaves the velocity unchanged, and
batches joined for the update (or the guidance's two branches) are padded again to their longest.
"""
from __future__ import annotations

import torch

from experts.flow_family import FamilyFrontEnd, FamilyVelocity
from experts.text_encoder import pad_features


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): the pipeline's 2x2 patches as tokens."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack`, to (B, C, height, width)."""
    b, _, channels = tokens.shape
    return (tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
            .reshape(b, channels // 4, height, width))


def padded_text(embeds: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Texts' embeddings (L_i, D) as one batch: right-padded with zeros to the longest, with the mask
    of the real tokens."""
    padded, pad = pad_features(embeds)
    return {"prompt_embeds": padded, "prompt_embeds_mask": ~pad}


class Velocity(FamilyVelocity):
    # the joint attention's projections, image and text stream (verl's Flow-GRPO for Qwen-Image adds the MLPs)
    LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]

    @staticmethod
    def conditioning(transformer: dict, model) -> tuple[dict, int]:
        """Qwen2.5-VL's last hidden states and their mask (padded at most to max_sequence_length)."""
        tokens = model.max_sequence_length
        return {"prompt_embeds": ((tokens, transformer["joint_attention_dim"]), None),
                "prompt_embeds_mask": ((tokens,), torch.bool)}, tokens

    def velocity(self, x, sigma, cond) -> torch.Tensor:
        dtype = self.transformer.dtype
        batch, _, height, width = x.shape
        out = self.transformer(hidden_states=pack(x).to(dtype), timestep=(sigma * 1000.0).to(dtype) / 1000,
                               encoder_hidden_states=cond["prompt_embeds"].to(dtype),
                               encoder_hidden_states_mask=cond["prompt_embeds_mask"],
                               img_shapes=[[(1, height // 2, width // 2)]] * batch).sample
        return unpack(out.float(), height, width)

    @staticmethod
    def merge_conditions(conds: list[dict]) -> dict[str, torch.Tensor]:
        """Several batches' conditioning as one, padded again to the longest text of them all."""
        return padded_text([e[m] for c in conds for e, m in zip(c["prompt_embeds"], c["prompt_embeds_mask"])])

    def guide(self, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Qwen-Image's true CFG: each packed token's guided velocity rescaled to the conditional one's norm."""
        negative, positive = pack(uncond), pack(cond)
        combined = negative + self.spec.guidance_scale * (positive - negative)
        rescaled = combined * (positive.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        return unpack(rescaled, *cond.shape[-2:])


class FrontEnd(FamilyFrontEnd):
    COMPONENTS = ("scheduler", "vae", "text_encoder", "tokenizer")

    def __init__(self, config, device: torch.device):
        from diffusers import QwenImagePipeline
        super().__init__(config, device)
        self.pipeline = QwenImagePipeline(transformer=None, **self.parts)

    def latent_grid(self, image_size: int) -> tuple[int, ...]:
        # the pipeline's latent side: 2 * (size // (2 * vae_scale_factor)), even for the 2x2 packing
        side = 2 * self.check_side(2 * 2 ** len(self.vae.temperal_downsample))
        return self.vae.config.z_dim, side, side

    def features(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each text's embeddings at its own length (the pipeline pads a batch to its longest: the
        real tokens come first)."""
        embeds, mask = self.pipeline.encode_prompt(prompt=texts, device=self.device,
                                                   max_sequence_length=self.spec.max_sequence_length)
        lengths = mask.sum(1).tolist() if mask is not None else [embeds.shape[1]] * len(texts)  # None: no padding
        return [{"prompt_embeds": e[:n].clone()} for e, n in zip(embeds, lengths)]

    def join(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return padded_text([f["prompt_embeds"] for f in features])

    def sigmas(self, steps: int) -> torch.Tensor:
        _, height, width = self.latent_shape
        return self.token_shifted_sigmas(steps, (height // 2) * (width // 2))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        c, dtype = self.vae.config, self.vae.dtype
        frames = latents[:, :, None].to(dtype)  # the VAE's (B, C, frames=1, H, W)
        mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(latents.device, dtype)
        inverse_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(latents.device, dtype)
        return self.vae.decode(frames / inverse_std + mean).sample[:, :, 0].float().clamp(-1, 1)
