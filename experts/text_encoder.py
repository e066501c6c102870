"""The frozen text encoder and its feature cache.

The cache is keyed by (encoder version, token ids): a sync of a refiner or of the generator leaves
the encoder's version unchanged, so its entries keep hitting across those syncs. It is bounded in
bytes (`FeatureCache`): refined prompts are almost all unique, so an unbounded cache grows every step.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import torch

from experts.layers import Trunk, padding_mask
from tasks.base import Vocabulary


class TextEncoder(Trunk):
    """Bidirectional features of right-padded token ids of `vocab`; its trunk (and so its state
    dict) is the tiny LM's, without the head."""

    def __init__(self, vocab: Vocabulary, d_model: int, n_layers: int, n_heads: int, *, max_len: int):
        super().__init__(len(vocab.words), d_model, n_layers, n_heads, max_len=max_len)
        self.pad = vocab.pad

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return self.trunk(ids, positions, padding_mask(ids == self.pad))


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


def held_bytes(features) -> int:
    """The bytes `features` (a tensor or a dict of them) keep alive: their whole storages, so that a
    view into a larger batch counts as that batch."""
    tensors = features.values() if isinstance(features, dict) else [features]
    return sum(t.untyped_storage().nbytes() for t in tensors)


class FeatureCache:
    """Text features by key, the least recently used evicted first so that the bytes held
    (`held_bytes`) never exceed `max_bytes`; 0 keeps nothing. An entry must own its storage (a
    clone, not a view into its batch), else it counts as the batch it views."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = int(max_bytes), 0
        self.entries: OrderedDict[Hashable, object] = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key):
        """The features of `key` (now the most recently used), or None."""
        if key not in self.entries:
            return None
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key, features) -> None:
        """Keep `features` under `key`, evicting the least recently used until they fit; features
        bigger than the whole bound are not kept."""
        size = held_bytes(features)
        if key in self.entries or size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            self.bytes -= held_bytes(self.entries.popitem(last=False)[1])
        self.entries[key] = features
        self.bytes += size

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


def pad_features(feats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad per-sequence features (L_i, D) into (B, L, D) and a padding mask (B, L)."""
    n = max(f.shape[0] for f in feats)
    out = torch.zeros(len(feats), n, feats[0].shape[1], dtype=feats[0].dtype, device=feats[0].device)
    pad = torch.ones(len(feats), n, dtype=torch.bool, device=feats[0].device)
    for i, f in enumerate(feats):
        out[i, : f.shape[0]] = f
        pad[i, : f.shape[0]] = False
    return out, pad


class CachedEncoder:
    """Encodes token sequences, reusing features computed before under the same encoder version
    (at most `max_bytes` of them, in the encoder's dtype)."""

    def __init__(self, encoder: TextEncoder, max_bytes: int, version: int = 0):
        self.encoder = encoder.eval().requires_grad_(False)
        self.version = version
        self.cache = FeatureCache(max_bytes)
        self.stats = CacheStats()

    def load(self, state: dict, version: int) -> None:
        """A new encoder version: only then are the cached features stale."""
        self.encoder.load_state_dict(state)
        self.version = version
        self.cache.clear()

    @torch.no_grad()
    def __call__(self, seqs: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [(self.version, tuple(s)) for s in seqs]
        self.stats.count(keys, self.cache)
        found = {k: self.cache.get(k) for k in dict.fromkeys(keys)}
        missing = [k for k, f in found.items() if f is None]
        if missing:
            n = max(len(k[1]) for k in missing)
            ids = torch.tensor([list(k[1]) + [self.encoder.pad] * (n - len(k[1])) for k in missing],
                               device=self.encoder.tok.weight.device)
            for k, f in zip(missing, self.encoder(ids)):
                found[k] = f[: len(k[1])].clone()
                self.cache.put(k, found[k])
        return pad_features([found[k] for k in keys])

    def take_stats(self) -> tuple[int, int]:
        """Hits and misses since the last call."""
        return self.stats.take()
