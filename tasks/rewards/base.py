"""What a reward term is: a scorer called on a batch, returning one value per sample.

A term (`reward.terms.<name>`) is scored by its `fn`: either a plain function or a class. A
function is called on every batch. A class (every built-in is one) is constructed once per place
that scores — a reward actor, or a rollout worker when the term has no actors — with its validated
options and the device it was given, so that a reward model is loaded once, then called on
batches:

    scorer(images, prompts, refinements) -> array of B floats

- `images`: (B, 3, H, W) float32 in [-1, 1], as the generator decodes them (`pil_images` converts);
- `prompts`: the *original* prompt records (`.text`, `.metadata`: e.g. GenEval's `include`);
- `refinements`: per sample {refiner id: Refinement}, already narrowed to the refiners that own
  the term (all of them where nobody owns it); {} for a sample that was not refined.

A class may also define `strict(images, prompts, refinements)`: a per-sample 0/1 correctness that
`jointrl eval` reports beside the mean (GenEval's accuracy). Options a class takes beyond the
common ones are declared in its `Options` (a pydantic model; unknown keys are config errors).
"""
from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np
import torch
from pydantic import Field

from experts.spec import Strict
from tasks.base import Refinement, to_uint8

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Options(Strict):
    """Keys every reward model takes; a built-in's `Options` adds its own."""
    model: str | None = Field(None, description="the model: a local folder, a hub id or `tiny:<kind>` (a tiny "
                                                "random one, for tests); None: the built-in's default")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the model's dtype")
    batch_size: int = Field(16, ge=1, description="images per forward pass: every call (from a rollout worker, "
                                                  "or of `images_per_call` images to a reward actor) runs in "
                                                  "passes of this many")


class RewardModel:
    """A built-in reward term. Subclasses set `default_model` (the hub id loaded when `model` is
    unset), `packages` (what it imports; preflight names the extra to install) and `Options`."""
    Options = Options
    default_model: str | None = None
    packages: tuple[str, ...] = ()
    needs_images = True  # False: a text term, scored on refinements alone

    def __init__(self, options: Options, device: torch.device):
        self.options, self.device = options, device

    @property
    def model_name(self) -> str | None:
        return self.options.model or self.default_model

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.options.dtype]

    def __call__(self, images: np.ndarray, prompts: Sequence[Any],
                 refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        raise NotImplementedError

    def batches(self, n: int):
        """Row slices of at most `options.batch_size`."""
        size = self.options.batch_size
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def pil_images(images: np.ndarray) -> list:
    """Generator images (B, 3, H, W) in [-1, 1] as RGB PIL images, as processors take them."""
    from PIL import Image
    return [Image.fromarray(to_uint8(np.asarray(im, dtype=np.float32))) for im in images]


def merged(refinements: dict[str, Refinement]) -> Refinement | None:
    """The refinements of one sample read as one text (in refiner order); None: not refined."""
    if not refinements:
        return None
    refs = list(refinements.values())
    formats = [r.formatted for r in refs if r.formatted is not None]
    return Refinement(" ".join(r.text for r in refs if r.text), all(r.ended for r in refs),
                      all(formats) if formats else None)
