"""`shapes` as a task: its training prompts and held-out sets (its reward: tasks/rewards/shapes.py).

Training prompts are `trainer.n_train_prompts` from the run's seed; the held-out set is fixed by
`evaluation.seed` and shares no clause set with them; its paraphrased copy has the same clauses in
other words, so a drop from one to the other measures prompt overfitting. With `task.rare_wording`,
that share of the training prompts (drawn from the run's seed) says its colours, shapes, counts and
relations in rare synonyms (tasks.shapes.rare_worded), and the held-out set is also scored so worded.
"""
from __future__ import annotations

import numpy as np

from common.seeding import derive_seed
from tasks.shapes import eval_set, paraphrase, prompt_set, rare_worded
from tasks.shapes_video import video_eval_set, video_prompt_set


class ShapesTask:
    name = "shapes"

    def __init__(self, config):
        self.config = config

    def train_prompts(self) -> list:
        t, share = self.config.trainer, self.config.task.rare_wording
        prompts = prompt_set(t.n_train_prompts, derive_seed(t.seed, "prompts"))
        if not share:
            return prompts
        rng = np.random.default_rng(derive_seed(t.seed, "rare-wording"))
        rare = set(rng.choice(len(prompts), size=round(share * len(prompts)), replace=False).tolist())
        return [rare_worded(p) if i in rare else p for i, p in enumerate(prompts)]

    def eval_sets(self) -> dict[str, list]:
        e = self.config.evaluation
        held = eval_set(e.per_category, e.seed, exclude=self.train_prompts())
        sets = {"held_out": held, "paraphrased": [paraphrase(p) for p in held]}
        return {**sets, "rare_wording": [rare_worded(p) for p in held]} if self.config.task.rare_wording else sets

    def check(self) -> None:
        """Nothing to check: the held-out set is built to share no clause set with training."""


class ShapesVideoTask:
    """`shapes_video`: clips of moving shapes (tasks/shapes_video.py); its held-out set, fixed by
    `evaluation.seed`, asks nothing a training prompt asks (no objects with the same motion)."""
    name = "shapes_video"

    def __init__(self, config):
        self.config = config

    def train_prompts(self) -> list:
        t = self.config.trainer
        return video_prompt_set(t.n_train_prompts, derive_seed(t.seed, "prompts"))

    def eval_sets(self) -> dict[str, list]:
        e = self.config.evaluation
        return {"held_out": video_eval_set(e.per_category, e.seed, exclude=self.train_prompts())}

    def check(self) -> None:
        """Nothing to check: the held-out set is built to ask nothing training asks."""
