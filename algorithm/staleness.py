"""How far behind each expert a step's samples are, and which of them are too stale to learn from.

With `cluster.max_staleness=k` the rollout for step t+k is made while step t updates, so a sample
is up to k versions behind an expert by the time that expert learns from it. Each sample's version
vector is checked per expert: one further behind than k is dropped (and counted); one ahead of an
expert was made with weights that expert never published, a bug the run must not hide. The lag
that remains is corrected by the update rules' importance ratio against the rollout's log-probs
(PPO's clipped ratio, as in asynchronous RLHF, arXiv 2410.18252).
"""
from __future__ import annotations

import numpy as np


def lags(vectors: list[dict], versions: dict[str, int]) -> dict[str, np.ndarray]:
    """Per expert, for every sample: how many versions the expert is ahead of the sample's weights."""
    out = {e: np.array([versions[e] - v[e] for v in vectors], dtype=int) for e in versions}
    ahead = {e: int(v[e]) for v in vectors for e in versions if v[e] > versions[e]}
    if ahead:
        raise RuntimeError(f"samples made with weights never published: {ahead}, expected at most {versions}")
    return out


def within(lag: dict[str, np.ndarray], bound: int) -> np.ndarray:
    """The samples no more than `bound` versions behind any expert."""
    return np.logical_and.reduce([v <= bound for v in lag.values()])
