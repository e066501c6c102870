"""What the loop, the rollout pipeline and a reward plug-in see of a task.

A task supplies training prompts and evaluation prompt sets (each prompt a record with `.text` and
a `.metadata` dict that travels with it to the reward), its default reward and its evaluation
measures. A reward plug-in is called as `fn(images, prompts, refinements, owners)`: images
(B, 3, H, W) in [-1, 1], the prompt records, per sample {refiner id: Refinement} and, per reward
term, the refiners that own it; it returns named terms (arrays of B).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

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


class PromptRecord(Protocol):
    """A prompt as every part of the run sees it."""
    text: str
    metadata: Mapping[str, Any]


@dataclass(frozen=True)
class TextPrompt:
    """A prompt given as plain text (e.g. `jointrl sample --prompt`): no metadata, nothing to score."""
    text: str
    metadata: Mapping[str, Any] = field(default_factory=dict)


def to_uint8(image: np.ndarray) -> np.ndarray:
    """An image as generators make them and rewards receive them, (3, H, W) in [-1, 1], as uint8 (H, W, 3)."""
    return np.clip((image.transpose(1, 2, 0) + 1) * 127.5, 0, 255).astype(np.uint8)


class Task(Protocol):
    name: str
    terms: tuple[str, ...]          # the default reward's terms
    text_terms: tuple[str, ...]     # those a refiner can own by default (refiner i: text_terms[i % n])

    def train_prompts(self) -> list[PromptRecord]:
        """The prompts training draws its steps from (fixed by the run's seed)."""

    def eval_sets(self) -> dict[str, list[PromptRecord]]:
        """Named held-out prompt sets for `jointrl eval`."""

    def reward(self, images, prompts, refinements, owners) -> dict[str, np.ndarray]:
        """The default reward (`reward.fn` unset)."""

    def measure(self, images: np.ndarray, prompts: Sequence[PromptRecord]) -> np.ndarray:
        """The evaluation measure per image (B,) in [0, 1], e.g. strict correctness."""
