"""The LAION aesthetic predictor v2: a linear MLP on L2-normalised CLIP ViT-L/14 image embeddings,
trained to regress human ratings (1-10) of SAC, LAION-Logos and AVA images.

Reference: github christophschuhmann/improved-aesthetic-predictor (`simple_inference.py`, 6934dd8:
`MLP.layers` l.46-61, `normalized` l.84-89), as Flow-GRPO uses it (`flow_grpo/aesthetic_scorer.py`
l.13-53, with `transformers`' CLIP). The layers have no activation between them (the ReLUs are
commented out there) and the dropouts are inert in eval mode, but they keep their places so the
state dict's keys are the reference's:

    layers.0.{weight,bias} (1024, 768)   layers.2.* (128, 1024)   layers.4.* (64, 128)
    layers.6.* (16, 64)                  layers.7.* (1, 16)

The head is read from safetensors (`head`, by default `aesthetic_head.safetensors` in the CLIP
folder); the released `sac+logos+ava1-l14-linearMSE.pth` converts as it is:
`save_file(torch.load("sac+logos+ava1-l14-linearMSE.pth", map_location="cpu"), "aesthetic_head.safetensors")`
(`save_file` from `safetensors.torch`; the .pth holds CUDA tensors).
The score is the head's output, on the ratings' 1-10 scale, as Flow-GRPO rewards it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from pydantic import Field
from torch import nn

from common.hub import local_model
from tasks.base import Refinement
from tasks.rewards.base import Options, RewardModel
from tasks.rewards.clip import ClipEncoder

HEAD_FILE = "aesthetic_head.safetensors"
LINEARS = (0, 2, 4, 6, 7)  # the Linear layers' places in `layers`


class AestheticHead(nn.Module):
    """The reference MLP with its input and hidden `widths` (768, 1024, 128, 64, 16 there)."""

    def __init__(self, widths: tuple[int, int, int, int, int]):
        super().__init__()
        d, h1, h2, h3, h4 = widths
        self.layers = nn.Sequential(nn.Linear(d, h1), nn.Dropout(0.2), nn.Linear(h1, h2), nn.Dropout(0.2),
                                    nn.Linear(h2, h3), nn.Dropout(0.1), nn.Linear(h3, h4), nn.Linear(h4, 1))

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds).squeeze(-1)


def load_head(path: Path) -> AestheticHead:
    """The head a safetensors file holds, its widths read from the weights' shapes."""
    from safetensors.torch import load_file
    state = load_file(str(path))
    widths = (state["layers.0.weight"].shape[1], *(state[f"layers.{i}.weight"].shape[0] for i in LINEARS[:-1]))
    head = AestheticHead(widths)
    head.load_state_dict(state)
    return head


class AestheticOptions(Options):
    head: str | None = Field(None, description=f"the head's safetensors file; None: {HEAD_FILE} in the model's "
                                               "folder (where `tiny:aesthetic` writes it)")


class Aesthetic(RewardModel):
    """LAION aesthetic predictor v2 on the images alone (the prompt is not read); see the module docstring."""
    Options = AestheticOptions
    default_model = "openai/clip-vit-large-patch14"
    packages = ("transformers",)

    def __init__(self, options: AestheticOptions, device: torch.device):
        super().__init__(options, device)
        path = Path(options.head or Path(local_model(self.model_name, options.revision)) / HEAD_FILE)
        if not path.is_file():
            raise ValueError(f"no aesthetic head at {path}: set `head` to the safetensors file of the MLP "
                             "(see tasks/rewards/aesthetic.py for converting the released .pth)")
        self.head = load_head(path).to(device).eval().requires_grad_(False)
        self.clip = ClipEncoder(self.model_name, self.model_name, self.dtype, device, revision=options.revision)

    @torch.no_grad()
    def __call__(self, images: np.ndarray, prompts: Sequence[Any],
                 refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        scores = np.empty(len(images), dtype=np.float64)
        for rows in self.batches(len(images)):
            scores[rows] = self.head(self.clip.images(images[rows]).float()).cpu().numpy()
        return scores
