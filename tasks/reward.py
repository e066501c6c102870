"""The shapes reward: named terms in [0, 1], scored against the *original* prompt.

`image` is the detector's partial credit for the generated image. The text terms judge a refinement
and are computed on the tokens of the refiners that own them (config), so each refiner can be given
a term of its own; a term nobody owns is computed on the whole composed refinement.
"""
from __future__ import annotations

import numpy as np

from tasks.base import Refinement, to_uint8
from tasks.shapes import COUNT_WORDS, SHAPES, STYLE_WORDS, Prompt, image_checks

IMAGE_TERMS = ("image",)
TEXT_TERMS = ("fidelity", "style", "format")
TERMS = IMAGE_TERMS + TEXT_TERMS


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


def _merge(refs: list[Refinement]) -> Refinement:
    formats = [r.formatted for r in refs if r.formatted is not None]
    return Refinement(" ".join(r.text for r in refs if r.text), all(r.ended for r in refs) if refs else False,
                      all(formats) if formats else None)


def text_scores(prompt: Prompt, refinements: dict[str, Refinement], owners: dict[str, list[str]]) -> dict:
    """The text terms of one sample; an unrefined sample (no refinements) scores 0 on each."""
    out = {}
    for term in TEXT_TERMS:
        ids = owners.get(term) or list(refinements)
        ref = _merge([refinements[i] for i in ids if i in refinements])
        out[term] = {"fidelity": lambda: fidelity(ref.words, prompt), "style": lambda: style(ref.words),
                     "format": lambda: format_term(ref)}[term]() if ref.words else 0.0
    return out


def shapes_reward(images: np.ndarray, prompts: list[Prompt], refinements: list[dict[str, Refinement]],
                  owners: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """Named reward terms for a batch: images (B, 3, H, W) in [-1, 1]."""
    terms = {t: np.zeros(len(prompts)) for t in TERMS}
    for i, (img, prompt, refs) in enumerate(zip(images, prompts, refinements)):
        terms["image"][i] = float(np.mean(image_checks(to_uint8(img), prompt)))
        for t, v in text_scores(prompt, refs, owners).items():
            terms[t][i] = v
    return terms
