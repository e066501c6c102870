"""A tiny DiT-style flow-matching velocity model: patchified images or clips, timestep and text conditioning.

Patches and projected text features attend jointly (as in SD3's MMDiT, in one stream); the
timestep and the pooled text modulate every block through adaLN-zero. A clip (B, C, F, H, W) is cut
into 3D patches of `frame_patch` frames by `patch` x `patch` pixels (as video DiTs patchify their
latent in time and space), an image (B, C, H, W) into 2D ones; either way the tokens carry a learnt
position. The generator interface the driver relies on is `forward(x, sigma, **cond) -> velocity`
and `merge_conditions`, which a diffusers transformer implements too (experts/sd3.py).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from experts.layers import Block, padding_mask
from experts.text_encoder import pad_features


def timestep_embedding(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=sigma.device) / half)
    args = sigma[:, None] * 1000.0 * freqs[None]
    return torch.cat([args.cos(), args.sin()], -1)


class TinyDiT(nn.Module):
    def __init__(self, image_size: int, channels: int, patch: int, d_model: int, *, n_layers: int,
                 n_heads: int, d_text: int, frames: int | None = None, frame_patch: int = 1):
        """`frames`: None for images; k for clips of k frames, patched `frame_patch` frames deep
        (k must be a multiple)."""
        super().__init__()
        if frames is not None and frames % frame_patch:
            raise ValueError(f"{frames} frames do not split into patches of {frame_patch} frames")
        self.channels, self.patch, self.side, self.frames = channels, patch, image_size // patch, frames
        self.frame_patch = frame_patch if frames is not None else 1
        self.depth = frames // frame_patch if frames is not None else 1  # patches along time
        self.patch_in = nn.Linear(channels * self.frame_patch * patch * patch, d_model)
        self.img_pos = nn.Parameter(torch.randn(1, self.depth * self.side ** 2, d_model) * 0.02)
        self.text_in = nn.Linear(d_text, d_model)
        self.pool_in = nn.Linear(d_text, d_model)
        self.t_mlp = nn.Sequential(nn.Linear(64, d_model), nn.SiLU(), nn.Linear(d_model, d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads, adaln=True) for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(d_model, elementwise_affine=False)
        self.final_ada = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, channels * self.frame_patch * patch * patch)
        nn.init.zeros_(self.final_ada.weight)
        nn.init.zeros_(self.final_ada.bias)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, [F,] H, W) -> tokens (B, patches, C * frame_patch * patch^2), time-major."""
        b, c, q, p, d, s = x.shape[0], self.channels, self.frame_patch, self.patch, self.depth, self.side
        return x.reshape(b, c, d, q, s, p, s, p).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, d * s * s, c * q * p * p)

    def unpatchify(self, t: torch.Tensor) -> torch.Tensor:
        b, c, q, p, d, s = t.shape[0], self.channels, self.frame_patch, self.patch, self.depth, self.side
        x = t.reshape(b, d, s, s, c, q, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(b, c, s * p, s * p) if self.frames is None else x.reshape(b, c, d * q, s * p, s * p)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor, text_pad: torch.Tensor):
        keep = (~text_pad).float()[..., None]
        pooled = (text * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        cond = self.t_mlp(timestep_embedding(sigma, 64)) + self.pool_in(pooled)
        img = self.patch_in(self.patchify(x)) + self.img_pos
        tokens = torch.cat([self.text_in(text), img], 1)
        pad = torch.cat([text_pad, torch.zeros(img.shape[:2], dtype=torch.bool, device=img.device)], 1)
        allowed = padding_mask(pad)
        for block in self.blocks:
            tokens = block(tokens, allowed, cond)
        shift, scale = self.final_ada(cond)[:, None].chunk(2, dim=-1)
        img = self.final_norm(tokens[:, text.shape[1]:]) * (1 + scale) + shift
        return self.unpatchify(self.out(img))

    @staticmethod
    def merge_conditions(conds: list[dict]) -> dict[str, torch.Tensor]:
        """Conditioning of several rollout shards as one batch: text features re-padded to a common length."""
        feats = [t[~p] for c in conds for t, p in zip(c["text"], c["text_pad"])]
        text, pad = pad_features(feats)
        return {"text": text, "text_pad": pad}
