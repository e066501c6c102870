"""What a reward term is: a scorer called on a batch, returning one value per sample.

A term (`reward.terms.<name>`) is scored by its `fn`: either a plain function or a class. A
function is called on every batch. A class (every built-in is one) is constructed once per place
that scores — a reward actor, or a rollout worker when the term has no actors — with its validated
options and the device it was given, so that a reward model is loaded once, then called on
batches:

    scorer(images, prompts, refinements) -> array of B floats

- `images`: (B, 3, H, W) float32 in [-1, 1], as the generator decodes them (`pil_images` converts);
  under a video task (`task.num_frames` set) each sample is a clip, (B, F, 3, H, W): a class says
  which it takes by `takes` ("images" or "clips"; an image term scores clips frame by frame under
  `per_frame`, tasks/rewards/frames.py; a user's code that does not say receives what the task makes);
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

from common.config import Strict
from common.hub import ModelRef
from common.loading import DTYPES
from tasks.base import Refinement, to_uint8


class Options(Strict):
    """Keys every reward model takes; a built-in's `Options` adds its own."""
    model: str | None = Field(None, description="the model: a local folder, a hub id or `tiny:<kind>` (a tiny "
                                                "random one, for tests); None: the built-in's default")
    revision: str | None = Field(None, description="the hub revision of `model` (a branch, tag or commit hash; "
                                                   "pin a commit for runs that repeat); None: its default branch. "
                                                   "The other models a term names load their default branch")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the model's dtype")
    batch_size: int = Field(16, ge=1, description="images per forward pass: every call (from a rollout worker, "
                                                  "or of `images_per_call` images to a reward actor) runs in "
                                                  "passes of this many")


class RewardModel:
    """A built-in reward term. Subclasses set `default_model` (the hub id loaded when `model` is
    unset), `packages` (what it imports; preflight names the extra to install, `imports` where
    that depends on the options) and `Options`."""
    Options = Options
    default_model: str | None = None
    packages: tuple[str, ...] = ()
    needs_images = True  # False: a text term, scored on refinements alone
    takes: Literal["images", "clips"] = "images"  # what it scores: images (B, 3, H, W) or clips (B, F, 3, H, W)
    prompt_files = True  # False: it scores its own task's prompt records only, not prompts read from a file

    def __init__(self, options: Options, device: torch.device):
        self.options, self.device = options, device

    @classmethod
    def imports(cls, options: Options) -> tuple[str, ...]:
        """The packages scoring with `options` imports."""
        return cls.packages

    @classmethod
    def named_model(cls, options: Options) -> str | None:
        """The model `options` name: `model`, else the built-in's default."""
        return options.model or cls.default_model

    @classmethod
    def models(cls, options: Options) -> list[ModelRef]:
        """Every model the scorer loads, at the revision it loads: what `jointrl download` fetches."""
        name = cls.named_model(options)
        return [ModelRef(name, options.revision)] if name else []

    @property
    def model_name(self) -> str | None:
        return self.named_model(self.options)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.options.dtype]

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
