"""Temporal consistency of a clip: how alike its consecutive frames look to a CLIP image encoder.

The score of a clip of F frames is the mean over its F - 1 consecutive pairs of the cosine of the
frames' CLIP image embeddings, in [-1, 1] (1: every frame looks the same): the "frame consistency"
of text-driven video editing (Esser et al. 2023, Gen-1, arXiv 2302.03011: the mean cosine of CLIP
embeddings of consecutive frames), close to VBench's background consistency (Huang et al. 2024,
arXiv 2311.17982: CLIP features, each frame compared with the previous and the first). It is what
a flickering or collapsing video generator is penalised by. It does not read the prompt: weigh it
against a term that does (a static clip is perfectly consistent).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from tasks.base import Refinement
from tasks.rewards.base import Options, RewardModel
from tasks.rewards.clip import ClipEncoder


class TemporalConsistency(RewardModel):
    """Mean cosine of consecutive frames' CLIP image embeddings (see the module docstring)."""
    default_model = "openai/clip-vit-large-patch14"
    packages = ("transformers",)
    takes = "clips"
    min_frames = 2  # a pair to compare

    def __init__(self, options: Options, device: torch.device):
        super().__init__(options, device)
        self.clip = ClipEncoder(self.model_name, self.model_name, self.dtype, device, revision=options.revision)

    @torch.no_grad()
    def __call__(self, clips: np.ndarray, prompts: Sequence[Any],
                 refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        clips = np.asarray(clips)
        if clips.ndim != 5 or clips.shape[1] < 2:
            raise ValueError(f"temporal_consistency scores clips (B, F, 3, H, W) of at least 2 frames; got an array "
                             f"of shape {clips.shape}")
        frames = clips.reshape(-1, *clips.shape[2:])
        embeds = torch.cat([self.clip.images(frames[rows]).float() for rows in self.batches(len(frames))])
        embeds = embeds.reshape(*clips.shape[:2], -1)
        return (embeds[:, 1:] * embeds[:, :-1]).sum(-1).mean(1).cpu().numpy().astype(np.float64)
