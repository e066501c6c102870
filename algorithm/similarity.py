"""How alike a prompt group's samples are: the `groups/similarity` diagnostic.

The measure: the mean, over the pairs of a group's samples, of the cosine similarity of their
mean-centred pixels (each pair's Pearson correlation), every sample first area-averaged to
`SIZE` x `SIZE` per channel (a clip: per frame, and its frames into at most `SIZE` time bins;
its frames are one flattened sample). 1: the samples are one picture up to brightness and
contrast; about 0: unrelated pictures. Mean-centring keeps a shared background (the shapes
world's black) from making every pair look alike; a sample of one flat colour has no pattern to
correlate and is left out. It is a pixel measure, cheap where the images are, and not
PromptRL's image-image similarity (arXiv 2602.01382), which compares image embeddings.

It is computed where the images are and travels as sums: with u_i a sample's unit vector,
sum_{i<j} u_i . u_j = (|sum_i u_i|^2 - n) / 2, so each part of a group (a chunk, a worker's or a
rank's share: shares may split a group) is summarised by its count and sum of unit vectors, parts
are merged by adding them, and the mean over the group's n(n-1)/2 pairs is exact wherever the
group was split.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

SIZE = 8  # the side each frame is area-averaged to, and the most time bins a clip keeps
FLAT = 1e-6  # a centred sample shorter than this has no pattern (one flat colour)


class SimilaritySums(NamedTuple):
    """Per part of a prompt group: the group, how many of its samples have a pattern, and the sum
    of their unit vectors (`signatures`). A rollout's parts are concatenated, in any order."""
    groups: np.ndarray  # (K,) int
    counts: np.ndarray  # (K,) int
    sums: np.ndarray  # (K, D) float64

    @staticmethod
    def join(parts: list["SimilaritySums"]) -> "SimilaritySums":
        return SimilaritySums(*(np.concatenate([getattr(p, f) for p in parts]) for f in SimilaritySums._fields))


def signatures(samples: torch.Tensor) -> np.ndarray:
    """(B, D) float64 on the host: each image (B, 3, H, W) or clip (B, F, 3, H, W) area-averaged to
    SIZE x SIZE per channel and frame (a clip's frames to at most SIZE bins), flattened, centred on
    its own mean and scaled to unit length; a flat sample's row is zero."""
    clips = samples.detach().float().unsqueeze(1) if samples.dim() == 4 else samples.detach().float()
    pooled = F.adaptive_avg_pool3d(clips.transpose(1, 2), (min(clips.shape[1], SIZE), SIZE, SIZE))
    centred = pooled.flatten(1).cpu().double().numpy()
    centred -= centred.mean(axis=1, keepdims=True)
    norms = np.linalg.norm(centred, axis=1, keepdims=True)
    return np.where(norms > FLAT, centred / np.maximum(norms, FLAT), 0.0)


def group_sums(unit: np.ndarray, groups: list[int] | np.ndarray) -> SimilaritySums:
    """The per-group count and sum of the unit vectors `unit` (`signatures`) of one part's samples."""
    groups, patterned = np.asarray(groups), np.linalg.norm(unit, axis=1) > 0
    ids = np.unique(groups)
    return SimilaritySums(ids, np.array([int(patterned[groups == g].sum()) for g in ids]),
                          np.stack([unit[groups == g].sum(axis=0) for g in ids]))


def group_similarity(parts: SimilaritySums) -> dict[int, float]:
    """Per group with at least two patterned samples, their mean pairwise similarity, from its
    parts merged: (|sum u|^2 - n) / (n (n - 1))."""
    out = {}
    for g in np.unique(parts.groups):
        mine = parts.groups == g
        n, total = int(parts.counts[mine].sum()), parts.sums[mine].sum(axis=0)
        if n >= 2:
            out[int(g)] = float((total @ total - n) / (n * (n - 1)))
    return out
