"""The shapes task's reward terms, each in [0, 1] and scored against the *original* prompt.

`shapes_image` is the programmatic detector's partial credit for the image (its `strict` is
GenEval-style correctness); `shapes_video` the same for a clip of the `shapes_video` world, frame
by frame and on its motion. The text terms judge a refinement, read from the refiners that own the
term (every refiner where none does); an unrefined sample scores 0 on each.
"""
from __future__ import annotations

import numpy as np

from tasks.base import Refinement, to_uint8
from tasks.rewards.base import RewardModel, merged
from tasks.shapes import COUNT_WORDS, SHAPES, STYLE_WORDS, Prompt, image_checks, strict_correct
from tasks.shapes_video import clip_checks, clip_correct


def fidelity(words: tuple[str, ...], prompt: Prompt) -> float:
    """Fraction of the prompt's colour, shape and count words that the refinement restates."""
    said = {w[:-1] if w[:-1] in SHAPES else w for w in words}
    wanted = {o.colour for o in prompt.objects} | {o.shape for o in prompt.objects}
    wanted |= {w for o in prompt.objects for w, n in COUNT_WORDS.items() if n == o.count and n > 1}
    return len(wanted & said) / len(wanted)


def style(words: tuple[str, ...]) -> float:
    """Quality words: three distinct ones for full credit, diluted by every other word."""
    n_style = sum(w in STYLE_WORDS for w in words)
    return min(1.0, len(set(words) & set(STYLE_WORDS)) / 3) * n_style / len(words)


def format_term(ref: Refinement) -> float:
    """A well-formed refinement: it stops by itself, repeats no word, and is 2 to 5 words long;
    0 if it broke the answer format it was asked for."""
    if not ref.words or ref.formatted is False:
        return 0.0
    return (float(ref.ended) + float(len(set(ref.words)) == len(ref.words))
            + float(2 <= len(ref.words) <= 5)) / 3


class ShapesImage(RewardModel):
    """The detector's partial credit: colour coverage, shape and exact count of each object, and
    the relation between two (tasks/shapes.py `image_checks`)."""
    prompt_files = False  # it reads the shapes task's prompt records (their objects), not text

    def __call__(self, images, prompts, refinements) -> np.ndarray:
        return np.array([float(np.mean(image_checks(to_uint8(im), p))) for im, p in zip(images, prompts)])

    def strict(self, images, prompts, refinements) -> np.ndarray:
        """GenEval-style correctness: every check of the prompt's clauses passes."""
        return np.array([float(strict_correct(to_uint8(im), p)) for im, p in zip(images, prompts)])


class ShapesVideo(RewardModel):
    """The detector on every frame of a clip (B, F, 3, H, W) and on its motion: each object's colour,
    shape and count per frame, the direction and extent of the motion the prompt asks
    (tasks/shapes_video.py `clip_checks`)."""
    prompt_files = False  # it reads the shapes_video task's prompt records (objects, motion), not text
    takes = "clips"
    min_frames = 2  # a motion to judge

    def __call__(self, images, prompts, refinements) -> np.ndarray:
        return np.array([float(np.mean(clip_checks(clip_of(im), p))) for im, p in zip(images, prompts)])

    def strict(self, images, prompts, refinements) -> np.ndarray:
        """Every check passes: each object right in every frame, and the motion as asked."""
        return np.array([float(clip_correct(clip_of(im), p)) for im, p in zip(images, prompts)])


def clip_of(sample: np.ndarray) -> np.ndarray:
    """A generated clip (F, 3, H, W) in [-1, 1] as uint8 (F, H, W, 3); an image is an error named here."""
    if np.ndim(sample) != 4:
        raise ValueError(f"shapes_video scores clips (F, 3, H, W), got a sample of shape {np.shape(sample)}: "
                         f"set task.num_frames")
    return to_uint8(sample)


class ShapesText(RewardModel):
    """A term on the composed refinement of the refiners that own it."""
    needs_images = False

    def score(self, ref: Refinement, prompt: Prompt) -> float:
        raise NotImplementedError

    def __call__(self, images, prompts, refinements) -> np.ndarray:
        out = np.zeros(len(prompts))
        for i, (prompt, refs) in enumerate(zip(prompts, refinements)):
            ref = merged(refs)
            out[i] = self.score(ref, prompt) if ref is not None and ref.words else 0.0
        return out


class ShapesFidelity(ShapesText):
    def score(self, ref, prompt):
        return fidelity(ref.words, prompt)


class ShapesStyle(ShapesText):
    def score(self, ref, prompt):
        return style(ref.words)


class ShapesFormat(ShapesText):
    def score(self, ref, prompt):
        return format_term(ref)
