"""What the loop, the rollout pipeline and a reward plug-in see of a task.

A task supplies training prompts and evaluation prompt sets, each prompt a record with `.text` and
a `.metadata` dict that travels with it to the reward terms (tasks/rewards/base.py says how a term
is called).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, Protocol

import numpy as np


@dataclass(frozen=True)
class Refinement:
    """One refiner's output for one sample: its text, whether it stopped by itself, and whether it
    kept to an answer format it was asked for (an HF refiner's `<answer>…</answer>`; None: none asked)."""
    text: str
    ended: bool
    formatted: bool | None = None

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(self.text.split())


@dataclass(frozen=True)
class Vocabulary:
    """The words a word-level model (a tiny refiner LM, a tiny text encoder) reads and writes, in id
    order, its four special tokens' ids among them, and the most words of a prompt it reads: what a
    task hands such a model, which then knows no task."""
    words: tuple[str, ...]
    pad: int
    bos: int
    eos: int
    sep: int
    max_prompt_words: int

    @cached_property
    def ids(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.words)}

    @property
    def special(self) -> tuple[int, ...]:
        return self.pad, self.bos, self.eos, self.sep

    def encode(self, words, limit: int) -> list[int]:
        """Ids of the first `limit` of `words` that are words of this vocabulary (a model of another
        vocabulary may write words this one cannot read; they are left out)."""
        return [self.ids[w] for w in words if w in self.ids and self.ids[w] not in self.special][:limit]

    def decode(self, ids) -> list[str]:
        """The words of `ids`, its special tokens left out."""
        return [self.words[i] for i in ids if i not in self.special]

    def compose(self, prompt: list[int], segments: list[list[int]], max_len: int | None,
                replace: bool = False) -> tuple[int, ...]:
        """The text a text encoder reads: <bos>, the prompt, then <sep> and each segment (a
        refinement, in refiner order), cut to its first `max_len` tokens (None: whole), as a real
        text encoder's tokenizer truncates at its maximum length: what does not fit is the last
        segments' tail. `replace`: the non-empty segments alone, joined by <sep>, in place of the
        prompt (where every segment is empty, what append reads: the prompt)."""
        if replace and (written := [segment for segment in segments if segment]):
            prompt, segments = written[0], written[1:]
        return (self.bos, *prompt, *[t for segment in segments for t in (self.sep, *segment)])[:max_len]


class PromptRecord(Protocol):
    """A prompt as every part of the run sees it."""
    text: str
    metadata: Mapping[str, Any]


@dataclass(frozen=True)
class TextPrompt:
    """A prompt given as plain text (e.g. `jointrl sample --prompt`): no metadata, nothing to score."""
    text: str
    metadata: Mapping[str, Any] = field(default_factory=dict)


def to_uint8(sample: np.ndarray) -> np.ndarray:
    """A sample as generators make them and rewards receive them, an image (3, H, W) or a video
    (F, 3, H, W) in [-1, 1], as uint8 (H, W, 3) or (F, H, W, 3)."""
    channels_last = np.moveaxis(np.asarray(sample), -3, -1)
    return np.clip((channels_last + 1) * 127.5, 0, 255).astype(np.uint8)


def from_uint8(pixels: np.ndarray) -> np.ndarray:
    """`to_uint8`'s inverse: uint8 (H, W, 3) or (F, H, W, 3) as the generator's (3, H, W) or
    (F, 3, H, W) float32 in [-1, 1], each 8-bit value k as (k + 0.5) / 127.5 - 1, the middle of the
    values `to_uint8` turns back into k (255: 1, the only value it turns into 255)."""
    return np.moveaxis(np.minimum((pixels.astype(np.float32) + 0.5) / 127.5 - 1, 1), -1, -3)


class Task(Protocol):
    name: str

    def train_prompts(self) -> list[PromptRecord]:
        """The prompts training draws its steps from."""

    def eval_sets(self) -> dict[str, list[PromptRecord]]:
        """Named held-out prompt sets for `jointrl eval`."""

    def check(self) -> None:
        """Raise ValueError if the evaluation sets share prompts with training."""
