"""The frozen text encoder and its feature cache.

The cache is keyed by (encoder version, token ids): a sync of a refiner or of the generator leaves
the encoder's version unchanged, so its entries keep hitting across those syncs.
"""
from __future__ import annotations

import torch

from experts.layers import Trunk, padding_mask
from tasks.shapes import PAD


class TextEncoder(Trunk):
    """Bidirectional features of right-padded token ids; its trunk (and so its state dict) is the
    tiny LM's, without the head."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return self.trunk(ids, positions, padding_mask(ids == PAD))


class CacheStats:
    """Hits and misses of a feature cache, counted until taken."""

    def __init__(self):
        self.hits = self.misses = 0

    def count(self, keys: list, cache) -> None:
        """One lookup of each of `keys`, counted before the missing ones are filled in: a hit where
        `cache` holds the key, else a miss."""
        n_miss = sum(k not in cache for k in keys)
        self.hits, self.misses = self.hits + len(keys) - n_miss, self.misses + n_miss

    def take(self) -> tuple[int, int]:
        """Hits and misses since the last call, and start counting again from zero."""
        out = (self.hits, self.misses)
        self.hits = self.misses = 0
        return out


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
        self.stats = CacheStats()

    def load(self, state: dict, version: int) -> None:
        """A new encoder version: only then are the cached features stale."""
        self.encoder.load_state_dict(state)
        self.version = version
        self.cache.clear()

    @torch.no_grad()
    def __call__(self, seqs: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [(self.version, tuple(s)) for s in seqs]
        missing = list(dict.fromkeys(k for k in keys if k not in self.cache))
        self.stats.count(keys, self.cache)
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
        return self.stats.take()
