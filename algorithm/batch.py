"""A step's samples: G per prompt, the last S of each group left unrefined.

GRPO samples a group of G outputs per prompt and normalises rewards within it (arXiv 2402.03300,
sec. 4.1.2); PromptRL keeps some of each group on the original prompt (prompt retention, arXiv
2602.01382 sec. 3.3), which is the in-group baseline refinements are measured against. Which
prompts a step uses is drawn from (seed, step) alone, so a resumed run draws the same ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from experts.seeding import derive_seed


@dataclass(frozen=True)
class Sample:
    """One sample of a step: its index in the step (it seeds every draw made for it), its prompt
    group, the prompt record, and whether the refiners refine it."""
    sample: int
    group: int
    prompt: object
    refine: bool


def step_samples(prompts: list, step: int, seed: int, prompts_per_step: int, group_size: int,
                 num_skip_refinement: int, refine: bool = True) -> list[Sample]:
    """`prompts_per_step` prompts drawn without replacement, G samples each; `refine=False`
    (generator-only) leaves every sample on its original prompt."""
    rng = np.random.default_rng(derive_seed(seed, "batch", step))
    chosen = rng.choice(len(prompts), size=prompts_per_step, replace=False)
    return [Sample(g * group_size + k, g, prompts[p], refine and k < group_size - num_skip_refinement)
            for g, p in enumerate(chosen) for k in range(group_size)]
