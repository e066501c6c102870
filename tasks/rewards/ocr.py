"""`ocr`: how well the image spells the text the prompt quotes, as Flow-GRPO's OCR reward.

Flow-GRPO's OCR prompts quote the text to render (`... a sign that reads "OPEN 24 HOURS"`). Its
reward (github yifan123/flow_grpo at ac4c86e, `flow_grpo/ocr.py`), replicated by `quoted` and
`ocr_reward`:

- l.31: the target is the text between the prompt's first two double quotes, `prompt.split('"')[1]`;
- l.46-47: the text read and the target are lowercased and their spaces (' ' only) removed;
- l.48-51: distance 0 if the target occurs anywhere in what was read, else their Levenshtein distance;
- l.53-54: the distance is clipped at the target's length ("only add one character penalty" for
  reading much unrelated text);
- l.60: reward = 1 - distance / len(target), so in [0, 1].

Where it differs:
- the reader: Flow-GRPO runs PaddleOCR, which detects text boxes, reads each, and joins the readings
  (with confidence > 0) without separators (l.44). Here a `transformers` OCR model reads the image
  (TrOCR by default: a ViT encoder and a text decoder, greedy, one `generate` per batch). TrOCR has
  no detector: it reads the whole image, resized to its input, as one line of text, so it suits
  images where the text fills the frame and under-reads text that is small in a scene.
- a prompt without quotes (Flow-GRPO: IndexError at l.31) or with an empty quote (ZeroDivisionError
  at l.60) is refused with a ValueError naming it; a failing OCR call (l.56-59: reward 0) is an
  error, not a zero.
"""
from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np
import torch
from pydantic import Field

from common.hub import local_model
from common.loading import pretrained
from tasks.base import Refinement
from tasks.rewards.base import Options, RewardModel, pil_images


def quoted(prompt: str) -> str:
    """The text the prompt asks to render: between its first two double quotes (Flow-GRPO l.31)."""
    parts = prompt.split('"')
    if len(parts) < 2:
        raise ValueError(f'the ocr reward needs the text to render in double quotes; this prompt has none: {prompt!r}')
    return parts[1]


def levenshtein(a: str, b: str) -> int:
    """The edit distance (insertions, deletions, substitutions of one character each), as
    `Levenshtein.distance` that Flow-GRPO calls."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def ocr_reward(target: str, read: str) -> float:
    """1 - (clipped) edit distance / target length, after lowercasing and removing spaces (Flow-GRPO
    l.46-60; see the module docstring)."""
    target, read = target.replace(" ", "").lower(), read.replace(" ", "").lower()
    if not target:
        raise ValueError("the ocr reward's quoted text is empty (or only spaces): there is nothing to read")
    distance = 0 if target in read else min(levenshtein(read, target), len(target))
    return 1 - distance / len(target)


class OCROptions(Options):
    max_new_tokens: int = Field(32, ge=1, description="the most tokens the OCR model reads per image")
    unquoted: Literal["error", "zero"] = Field("error", description="a prompt without quoted text: error (its "
                                               "sample is dropped, counted as a reward error) or zero (it scores 0; "
                                               "for prompt sets that mix text and other prompts)")


class OCR(RewardModel):
    """Flow-GRPO's OCR reward with a `transformers` vision-encoder-decoder OCR model as the reader
    (see the module docstring)."""
    Options = OCROptions
    default_model = "microsoft/trocr-base-printed"
    packages = ("transformers",)

    def __init__(self, options: OCROptions, device: torch.device):
        super().__init__(options, device)
        from transformers import AutoProcessor, VisionEncoderDecoderModel
        path = local_model(self.model_name, options.revision)
        self.processor = AutoProcessor.from_pretrained(path)
        self.model = pretrained(VisionEncoderDecoderModel, path, self.dtype, device).eval().requires_grad_(False)

    @torch.no_grad()
    def read(self, images: np.ndarray) -> list[str]:
        """What the model reads in each image: greedy decoding, one `generate` per batch."""
        texts = []
        for rows in self.batches(len(images)):
            pixels = self.processor(images=pil_images(images[rows]), return_tensors="pt")["pixel_values"]
            tokens = self.model.generate(pixels.to(self.device, self.dtype), do_sample=False, num_beams=1,
                                         max_new_tokens=self.options.max_new_tokens)
            texts += self.processor.batch_decode(tokens, skip_special_tokens=True)
        return texts

    def __call__(self, images: np.ndarray, prompts: Sequence[Any],
                 refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        asked = [('"' in p.text) or self.options.unquoted == "error" for p in prompts]
        targets = [quoted(p.text) if a else "" for p, a in zip(prompts, asked)]  # a bad prompt fails fast
        out = np.zeros(len(prompts))
        rows = [i for i, a in enumerate(asked) if a]
        if rows:
            read = self.read(images[rows])
            out[rows] = [ocr_reward(targets[i], text) for i, text in zip(rows, read)]
        return out
