"""A reward model as a plug-in: a small torch scorer beside the shapes terms.

`shapes_and_sharpness` returns the shapes terms plus `sharpness`: the mean Sobel edge magnitude of
the image, squashed into [0, 1] (crisp shape edges score high, blur and noise low). The scorer is a
torch module built once per process, so under `reward.actors=K` each reward actor holds one.
Use: `--set reward.fn=tasks.scorers:shapes_and_sharpness --set reward.weights.sharpness=0.2`.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from tasks.reward import shapes_reward


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


def shapes_and_sharpness(images, prompts, refinements, owners) -> dict[str, np.ndarray]:
    terms = shapes_reward(images, prompts, refinements, owners)
    terms["sharpness"] = scorer()(torch.as_tensor(np.asarray(images, dtype=np.float32))).numpy().astype(np.float64)
    return terms
