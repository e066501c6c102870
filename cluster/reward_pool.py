"""Rewards scored by a pool of Ray actors (`reward.actors=K`).

A reward model (a torch scorer, a VLM judge) is loaded once per actor, on the resources it asks
for (`reward.resources`, e.g. a GPU), and scores whole batches: every rollout worker sends its
share of a step as one call, to the pool's actors in turn. Scoring is a pure function of its
inputs, so an actor that died is waited for (Ray restarts it) and asked again, with the same result.
"""
from __future__ import annotations

import torch

from cluster.recovery import survive
from cluster.runtime import get
from tasks import build_task
from tasks.reward_guard import reward_fn


class RewardActor:
    def __init__(self, config, index: int):
        torch.set_num_threads(1)
        self.fn, self.index = reward_fn(config, build_task(config)), index

    def score(self, images, prompts, refinements, owners) -> dict:
        return self.fn(images, prompts, refinements, owners)

    def ready(self) -> int:
        return self.index


class PooledReward:
    """The reward function a rollout worker calls: each batch goes to the next actor of the pool,
    starting from the worker's own index so that workers spread over the pool."""

    def __init__(self, actors: list, first: int, attempts: int):
        self.actors, self.turn, self.attempts = actors, first, attempts

    def __call__(self, images, prompts, refinements, owners) -> dict:
        actor = self.actors[self.turn % len(self.actors)]
        self.turn += 1
        terms, _ = survive(lambda first: get(actor.score.remote(images, prompts, refinements, owners)),
                           lambda: get(actor.ready.remote()), self.attempts)
        return terms
