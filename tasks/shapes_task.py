"""`shapes` as a task: its training prompts, held-out sets, reward and strict-accuracy measure.

Training prompts are `trainer.n_train_prompts` from the run's seed; the held-out set is fixed by
`evaluation.seed` and shares no clause set with them; its paraphrased copy has the same clauses in
other words, so a drop from one to the other measures prompt overfitting.
"""
from __future__ import annotations

import numpy as np

from experts.seeding import derive_seed
from tasks import reward
from tasks.base import to_uint8
from tasks.shapes import eval_set, paraphrase, prompt_set, strict_correct


class ShapesTask:
    name = "shapes"
    terms = reward.TERMS
    text_terms = reward.TEXT_TERMS

    def __init__(self, config):
        self.config = config

    def train_prompts(self) -> list:
        t = self.config.trainer
        return prompt_set(t.n_train_prompts, derive_seed(t.seed, "prompts"))

    def eval_sets(self) -> dict[str, list]:
        e = self.config.evaluation
        held = eval_set(e.per_category, e.seed, exclude=self.train_prompts())
        return {"held_out": held, "paraphrased": [paraphrase(p) for p in held]}

    def reward(self, images, prompts, refinements, owners) -> dict[str, np.ndarray]:
        return reward.shapes_reward(images, prompts, refinements, owners)

    def measure(self, images: np.ndarray, prompts) -> np.ndarray:
        """Strict correctness: every GenEval-style check of the prompt's clauses passes."""
        return np.array([float(strict_correct(to_uint8(im), p)) for im, p in zip(images, prompts)])
