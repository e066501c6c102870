"""Text-image agreement by a CLIP-style dual encoder: `ClipScore` and `PickScore`.

Both embed a batch of images and their *original* prompts in one forward pass each, L2-normalise
the embeddings and score each image against its own prompt by cosine similarity; they differ in
the checkpoint, the processor and the scale.

- `ClipScore` returns, by `scale`, the plain cosine in [-1, 1] (`cosine`, the default: no clamp
  flattens the signal RL learns from, and a term's weight in the config already sets its scale), or
  CLIPScore as torchmetrics defines it, 100 * max(cos, 0) (`clipscore`; github Lightning-AI/
  torchmetrics `functional/multimodal/clip_score.py`: `100 * cos`, clamped at 0, so in [0, 100];
  Hessel et al. 2021, eq. 1, weigh it 2.5 instead of 100). torchmetrics clamps the mean of a
  batch, here each image is clamped: the two agree wherever no cosine is negative, as with real
  images and captions. Flow-GRPO (github yifan123/flow_grpo at ac4c86e) has no CLIP scorer
  (`flow_grpo/rewards.py` `multi_score` lists none).
- `PickScore` is `logit_scale.exp() * cos` (Kirstain et al. 2023; github yuvalkirstain/PickScore
  README `calc_probs`: `model.logit_scale.exp() * (text_embs @ image_embs.T)`), times `scale`:
  by default 1/26, Flow-GRPO's `flow_grpo/pickscore_scorer.py` l.49 `scores = scores/26` ("norm
  to 0-1"), so rewards and weights carry over from its recipes; `scale: 1` gives the paper's values.
"""
from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np
import torch
from pydantic import Field

from common.hub import ModelRef, local_model
from common.tiny import is_tiny
from common.loading import pretrained
from tasks.base import Refinement
from tasks.rewards.base import Options, RewardModel, pil_images

PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


def features(output) -> torch.Tensor:
    """The projected embedding `get_image_features`/`get_text_features` return: a tensor before
    transformers 5, the `pooler_output` of a model output since."""
    return getattr(output, "pooler_output", output)


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(p=2, dim=-1, keepdim=True)


class ClipEncoder:
    """A `CLIPModel` (at `revision`) and its processor, loaded once (in `dtype`, on `device`, in eval
    mode): the unit embeddings of a batch of images or texts, each in one forward pass."""

    def __init__(self, model: str, processor: str, dtype: torch.dtype, device: torch.device,
                 *, revision: str | None = None):
        from transformers import AutoProcessor, CLIPModel
        same = processor == model
        self.processor = AutoProcessor.from_pretrained(local_model(processor, revision if same else None, weights=same))
        self.model = pretrained(CLIPModel, local_model(model, revision), dtype, device).eval().requires_grad_(False)
        self.dtype, self.device = dtype, device

    @torch.no_grad()
    def images(self, images: np.ndarray) -> torch.Tensor:
        """(B, D) unit embeddings of generator images (B, 3, H, W) in [-1, 1]."""
        pixels = self.processor(images=pil_images(images), return_tensors="pt")["pixel_values"]
        return unit(features(self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))))

    @torch.no_grad()
    def texts(self, texts: list[str]) -> torch.Tensor:
        """(B, D) unit embeddings of texts, truncated to the text encoder's context (77 in CLIP)."""
        inputs = self.processor(text=texts, padding=True, truncation=True, return_tensors="pt",
                                max_length=self.model.config.text_config.max_position_embeddings)
        return unit(features(self.model.get_text_features(input_ids=inputs["input_ids"].to(self.device),
                                                          attention_mask=inputs["attention_mask"].to(self.device))))


class ClipScoreOptions(Options):
    scale: Literal["cosine", "clipscore"] = Field("cosine", description="cosine: the cosine of image and prompt "
                                                  "embeddings, in [-1, 1]; clipscore: 100 * max(cosine, 0), "
                                                  "CLIPScore as torchmetrics reports it, in [0, 100]")


class ClipScore(RewardModel):
    """CLIP's image-prompt cosine, or CLIPScore (see the module docstring)."""
    Options = ClipScoreOptions
    default_model = "openai/clip-vit-large-patch14"
    packages = ("transformers",)

    def __init__(self, options: Options, device: torch.device):
        super().__init__(options, device)
        self.clip = ClipEncoder(self.model_name, self.processor_of(options), self.dtype, device,
                                revision=options.revision)

    @classmethod
    def processor_of(cls, options: Options) -> str:
        """The processor's folder, hub id or tiny:<kind>."""
        return cls.named_model(options)

    @classmethod
    def models(cls, options: Options) -> list[ModelRef]:
        processor = cls.processor_of(options)
        alone = [ModelRef(processor, weights=False, option="processor")] \
            if processor != cls.named_model(options) else []
        return [*super().models(options), *alone]  # a processor of another repo: its files, not its weights

    def scaled(self, cosine: torch.Tensor) -> torch.Tensor:
        """The score of a batch's cosines (float32)."""
        return cosine if self.options.scale == "cosine" else 100 * cosine.clamp(min=0)

    @torch.no_grad()
    def __call__(self, images: np.ndarray, prompts: Sequence[Any],
                 refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        texts = [p.text for p in prompts]
        scores = np.empty(len(texts), dtype=np.float64)
        for rows in self.batches(len(texts)):
            cosine = (self.clip.images(images[rows]) * self.clip.texts(texts[rows])).sum(-1)
            scores[rows] = self.scaled(cosine.float()).cpu().numpy()
        return scores


class PickScoreOptions(Options):
    processor: str | None = Field(None, description="the processor: a local folder, a hub id or `tiny:<kind>`; "
                                                    f"None: {PICKSCORE_PROCESSOR} (a tiny model's own folder)")
    scale: float = Field(1 / 26, gt=0, description="multiplies logit_scale.exp() * cosine: 1/26 as Flow-GRPO "
                                                   "(about 0-1), 1 for the PickScore paper's values (about 18-24)")


class PickScore(ClipScore):
    """PickScore (Kirstain et al. 2023): a CLIP-H fine-tuned on Pick-a-Pic preferences; the score
    is `scale * logit_scale.exp() * cosine` (see the module docstring)."""
    Options = PickScoreOptions
    default_model = "yuvalkirstain/PickScore_v1"

    @classmethod
    def processor_of(cls, options: PickScoreOptions) -> str:
        if options.processor:
            return options.processor
        model = cls.named_model(options)
        return model if is_tiny(model) else PICKSCORE_PROCESSOR

    def scaled(self, cosine: torch.Tensor) -> torch.Tensor:
        return self.options.scale * self.clip.model.logit_scale.exp().float() * cosine
