"""Reward terms scored by pools of Ray actors (`reward.terms.<name>.actors=K`).

Each such term has a pool of its own: its reward model (a CLIP scorer, a detector, a VLM judge) is
loaded once per actor, on the resources the term asks for (e.g. a share of a GPU), and scores
whole batches: every rollout worker sends its share of a step as one call per term, to the term's
actors in turn, and the pools of different terms are called at once (tasks/reward_guard.py).
Scoring is a pure function of its inputs, so an actor that died is waited for (Ray restarts it)
and asked again, with the same result.
"""
from __future__ import annotations

import torch

from cluster.recovery import survive
from cluster.runtime import get
from experts.devices import actor_device
from tasks.rewards.term import build_scorer


class RewardActor:
    def __init__(self, config, term: str, index: int):
        torch.set_num_threads(1)
        _, resources = config.reward.pools()[term]
        self.device, self.index = actor_device(resources), index
        self.scorer = build_scorer(config.reward.terms[term], self.device)

    def score(self, images, prompts, refinements):
        return self.scorer(images, prompts, refinements)

    def strict(self, images, prompts, refinements):
        """The scorer's strict correctness, or None if it has none."""
        strict = getattr(self.scorer, "strict", None)
        return strict(images, prompts, refinements) if strict else None

    def ready(self) -> int:
        return self.index


def pool_names(config) -> dict[str, list[str]]:
    """Every pooled term's actors' names: `reward/<term>/<k>`."""
    return {term: [f"reward/{term}/{k}" for k in range(n)] for term, (n, _) in config.reward.pools().items()}


def spawn_pools(config, runtime) -> dict[str, list]:
    """Every pooled term's actors (`pool_names`)."""
    pools = config.reward.pools()
    return {term: [runtime.spawn_member(RewardActor, config, term, k, name=name, resources=pools[term][1])
                   for k, name in enumerate(names)]
            for term, names in pool_names(config).items()}


class PooledTerm:
    """The scorer a rollout worker calls for a pooled term: each batch goes to the pool's next
    actor, starting from the worker's own index so that workers spread over the pool."""

    def __init__(self, actors: list, first: int, attempts: int):
        self.actors, self.turn, self.attempts = actors, first, attempts

    def __call__(self, images, prompts, refinements):
        return self.ask("score", images, prompts, refinements)

    def strict(self, images, prompts, refinements):
        return self.ask("strict", images, prompts, refinements)

    def ask(self, method: str, *args):
        actor = self.actors[self.turn % len(self.actors)]
        self.turn += 1
        values, _ = survive(lambda first: get(getattr(actor, method).remote(*args)),
                            lambda: get(actor.ready.remote()), self.attempts)
        return values
