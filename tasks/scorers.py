"""A reward model as a user's plug-in: a small torch scorer as a term of its own.

`sharpness` is the mean Sobel edge magnitude of the image, squashed into [0, 1] (crisp shape edges
score high, blur and noise low). The scorer is a torch module built once per process, so under
`reward.terms.sharpness.actors=K` each reward actor holds one.
Use: `--set 'reward.terms.sharpness={fn: tasks.scorers:sharpness, weight: 0.2}'`.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn


class SharpnessScorer(nn.Module):
    """Mean Sobel gradient magnitude of the grey image, through 1 - exp(-k x)."""

    def __init__(self, k: float = 4.0):
        super().__init__()
        sobel = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
        self.register_buffer("kernels", torch.stack([sobel, sobel.T])[:, None] / 8)
        self.k = k

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        grey = images.mean(1, keepdim=True)
        grad = nn.functional.conv2d(grey, self.kernels, padding=1)
        return 1 - torch.exp(-self.k * grad.norm(dim=1).mean((1, 2)))


@functools.lru_cache(maxsize=1)
def scorer() -> SharpnessScorer:
    return SharpnessScorer().eval()


def sharpness(images, prompts, refinements) -> np.ndarray:
    return scorer()(torch.as_tensor(np.asarray(images, dtype=np.float32))).numpy().astype(np.float64)
