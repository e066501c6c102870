"""A step's samples: G per prompt, the last S of each group left unrefined.

GRPO samples a group of G outputs per prompt and normalises rewards within it (arXiv 2402.03300,
sec. 4.1.2); PromptRL keeps some of each group on the original prompt (prompt retention, arXiv
2602.01382 sec. 3.3), which is the in-group baseline refinements are measured against.

Prompts are taken in epochs: each epoch is a permutation of the prompt set drawn from (seed,
epoch), and step t takes the next `prompts_per_step` of that sequence, so every prompt is seen
once per epoch and a resumed run draws exactly the prompts the uninterrupted one would.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.seeding import derive_seed


@dataclass(frozen=True)
class Sample:
    """One sample of a step: its index in the step (it seeds every draw made for it), its prompt
    group, the prompt record, and whether the refiners refine it."""
    sample: int
    group: int
    prompt: object
    refine: bool


def step_prompts(n: int, step: int, seed: int, prompts_per_step: int) -> list[int]:
    """The indices of step `step`'s prompts in a set of `n`: positions step*P .. step*P+P-1 of the
    concatenated per-epoch permutations."""
    start = step * prompts_per_step
    orders = {epoch: np.random.default_rng(derive_seed(seed, "epoch", epoch)).permutation(n)
              for epoch in {p // n for p in range(start, start + prompts_per_step)}}
    return [int(orders[p // n][p % n]) for p in range(start, start + prompts_per_step)]


def step_samples(prompts: list, *, step: int, seed: int, prompts_per_step: int, group_size: int,
                 num_skip_refinement: int, refine: bool = True) -> list[Sample]:
    """The step's prompts (`step_prompts`), G samples each; `refine=False` (generator-only) leaves
    every sample on its original prompt."""
    return [Sample(g * group_size + k, g, prompts[p], refine and k < group_size - num_skip_refinement)
            for g, p in enumerate(step_prompts(len(prompts), step, seed, prompts_per_step))
            for k in range(group_size)]
