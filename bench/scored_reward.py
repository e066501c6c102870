"""A reward term for bench/perf.py, beside the shapes terms: a reward model's forward pass of a
fixed cost, as a learned scorer (ImageReward, a VLM judge) adds to every rollout.

The scorer is a small random-weight CNN run `JOINTRL_SCORER_PASSES` times over the batch (read
from the environment, so the bench can set the cost it calibrated); its score is the term
`scorer`, which the bench gives weight 0.
Use: `reward.terms.scorer={fn: bench.scored_reward:scorer_term, weight: 0.0}`.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch


@functools.lru_cache(maxsize=1)
def scorer() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.GELU(),
                               torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.GELU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 1)).eval()


def score(images: np.ndarray, passes: int) -> np.ndarray:
    """The scorer's mean output per image over `passes` forward passes (each the same)."""
    x = torch.as_tensor(np.asarray(images, dtype=np.float32))
    total = torch.zeros(len(x))
    with torch.no_grad():
        for _ in range(passes):
            total += scorer()(x).squeeze(1)
    return (total / max(passes, 1)).numpy().astype(np.float64)


def scorer_term(images, prompts, refinements):
    return score(images, int(os.environ.get("JOINTRL_SCORER_PASSES", "0")))
