"""Reward models as a user's plug-ins: small scorers as terms of their own.

`sharpness` (an image term: `takes = "images"`, so on a video task it needs `per_frame`) is the mean Sobel edge magnitude of the image, squashed into [0, 1] (crisp shape edges
score high, blur and noise low). The scorer is a torch module built once per process, so under
`reward.terms.sharpness.actors=K` each reward actor holds one.
Use: `--set 'reward.terms.sharpness={fn: tasks.scorers:sharpness, weight: 0.2}'`.

`Motion` (a video term: `takes = "clips"`) is a class scoring whole clips (B, F, 3, H, W): how much
a clip moves, the mean absolute change between consecutive frames (of values in [-1, 1], so in
[0, 2]), times `scale`; with `temporal_consistency` it keeps a generator from buying consistency
with still clips. Use: `--set 'reward.terms.motion={fn: tasks.scorers:Motion, scale: 4, weight: 0.1}'`.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from pydantic import Field
from torch import nn

from common.config import Strict


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


sharpness.takes = "images"  # it reads (B, 3, H, W)


class Motion:
    """The mean absolute frame-to-frame change of each clip, times `scale`."""
    takes = "clips"

    class Options(Strict):
        scale: float = Field(1.0, gt=0, description="multiplies the mean absolute change between frames")

    def __init__(self, options: Options, device):
        self.scale = options.scale

    def __call__(self, clips, prompts, refinements) -> np.ndarray:
        clips = np.asarray(clips, dtype=np.float32)
        if clips.ndim != 5:
            raise ValueError(f"Motion scores clips (B, F, 3, H, W); got {clips.shape}")
        return self.scale * np.abs(np.diff(clips, axis=1)).mean((1, 2, 3, 4), dtype=np.float64)
