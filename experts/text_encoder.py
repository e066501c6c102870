"""The frozen text encoder and its feature cache.

The cache is keyed by (encoder version, token ids): a sync of a refiner or of the generator leaves
the encoder's version unchanged, so its entries keep hitting across those syncs.
"""
from __future__ import annotations

import torch
from torch import nn

from experts.layers import Block, padding_mask
from tasks.shapes import PAD


class TextEncoder(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == PAD
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))[None]
        allowed = padding_mask(pad)
        for block in self.blocks:
            x = block(x, allowed)
        return self.norm(x)


def pad_features(feats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad per-sequence features (L_i, D) into (B, L, D) and a padding mask (B, L)."""
    n = max(f.shape[0] for f in feats)
    out = torch.zeros(len(feats), n, feats[0].shape[1], device=feats[0].device)
    pad = torch.ones(len(feats), n, dtype=torch.bool, device=feats[0].device)
    for i, f in enumerate(feats):
        out[i, : f.shape[0]] = f
        pad[i, : f.shape[0]] = False
    return out, pad


class CachedEncoder:
    """Encodes token sequences, reusing features computed before under the same encoder version."""

    def __init__(self, encoder: TextEncoder, version: int = 0):
        self.encoder = encoder.eval().requires_grad_(False)
        self.version = version
        self.cache: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self.hits = self.misses = 0

    def load(self, state: dict, version: int) -> None:
        """A new encoder version: only then are the cached features stale."""
        self.encoder.load_state_dict(state)
        self.version = version
        self.cache.clear()

    @torch.no_grad()
    def __call__(self, seqs: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [(self.version, tuple(s)) for s in seqs]
        missing = list(dict.fromkeys(k for k in keys if k not in self.cache))
        n_miss = sum(k not in self.cache for k in keys)
        self.hits, self.misses = self.hits + len(keys) - n_miss, self.misses + n_miss
        if missing:
            n = max(len(k[1]) for k in missing)
            ids = torch.tensor([list(k[1]) + [PAD] * (n - len(k[1])) for k in missing],
                               device=self.encoder.tok.weight.device)
            feats = self.encoder(ids)
            for k, f in zip(missing, feats):
                self.cache[k] = f[: len(k[1])].clone()
        return pad_features([self.cache[k] for k in keys])

    def take_stats(self) -> tuple[int, int]:
        """Hits and misses since the last call."""
        out = (self.hits, self.misses)
        self.hits = self.misses = 0
        return out
