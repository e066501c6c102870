"""Reward terms scored by pools of Ray actors (`reward.terms.<name>.actors=K`).

Each such term has a pool of its own: its reward model (a CLIP scorer, a detector, a VLM judge) is
loaded once per actor, on the resources the term asks for (e.g. a GPU), and scores batches: every
rollout worker sends each batch it scores in calls of `reward.terms.<name>.images_per_call` images
(the whole batch in one call by default), to the term's actors in turn and at once; an actor's
scorer runs a call in forward passes of its own `batch_size`. The pools of different terms are
called at once too (tasks/reward_guard.py). What an actor returns is on the host: numpy, whatever
device its model runs on.
Scoring is a pure function of its inputs, so an actor that died is waited for (Ray restarts it)
and asked again, with the same result.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch
from ray.exceptions import RayActorError

from cluster.recovery import Retry
from cluster.runtime import get
from cluster.startup import reports_start, start_failure
from experts.devices import actor_device
from tasks.rewards.term import build_scorer


class RewardActor:
    @reports_start
    def __init__(self, config, term: str, index: int):
        torch.set_num_threads(1)
        _, resources = config.reward.pools()[term]
        self.device, self.index = actor_device(resources), index
        self.scorer = build_scorer(config.reward.terms[term], self.device, term)

    def score(self, images, prompts, refinements):
        return on_host(self.scorer(images, prompts, refinements))

    def strict(self, images, prompts, refinements):
        """The scorer's strict correctness, or None if it has none."""
        strict = getattr(self.scorer, "strict", None)
        return on_host(strict(images, prompts, refinements)) if strict else None

    def ready(self) -> int:
        return self.index


def on_host(values):
    """A scorer's answer as it leaves the actor: a tensor (a plug-in's, maybe on a GPU) as a numpy
    array on the host; anything else as it is (the caller checks it: tasks/reward_guard.py)."""
    return values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else values


def pool_names(config) -> dict[str, list[str]]:
    """Every pooled term's actors' names: `reward/<term>/<k>`."""
    return {term: [f"reward/{term}/{k}" for k in range(n)] for term, (n, _) in config.reward.pools().items()}


def spawn_pools(config, runtime) -> dict[str, list]:
    """Every pooled term's actors (`pool_names`)."""
    pools = config.reward.pools()
    return {term: [runtime.spawn_member(RewardActor, config, term, k, name=name, resources=pools[term][1],
                                        runtime_env=config.reward.terms[term].runtime_env)
                   for k, name in enumerate(names)]
            for term, names in pool_names(config).items()}


def pooled_scorers(config, members, index: int, who: str) -> dict[str, "PooledTerm"]:
    """term -> the scorer that asks its pool, for every pooled term, found among the run's
    `members`; `index` spreads the callers (`who`, named in the error) over each pool."""
    pools = pool_names(config)
    if pools and members is None:
        raise ValueError(f"{who}: reward.terms {sorted(pools)} are scored by reward actors; it needs the run's "
                         f"members to find them")
    return {term: PooledTerm([members(name) for name in names], index, config.cluster,
                             config.reward.terms[term].images_per_call)
            for term, names in pools.items()}


class PooledTerm:
    """The scorer a rollout worker calls for a pooled term: a batch in calls of `images_per_call`
    (None: one call), each to the pool's next actor, all at once; the worker's first call goes to
    the actor of its own index, so that workers spread over the pool."""

    def __init__(self, actors: list, first: int, restarts, images_per_call: int | None = None):
        """`restarts`: the config's cluster section (how often and how long an actor is waited for)."""
        self.actors, self.turn, self.images_per_call = actors, first, images_per_call
        self.retry = Retry(restarts)  # a reward actor's restart is not among the run's fault counts

    def __call__(self, images, prompts, refinements):
        return self.ask("score", images, prompts, refinements)

    def strict(self, images, prompts, refinements):
        return self.ask("strict", images, prompts, refinements)

    def calls(self, n: int) -> list[slice]:
        """The rows of each call for a batch of `n` (one call for an empty batch)."""
        size = self.images_per_call or max(n, 1)
        return [slice(i, i + size) for i in range(0, max(n, 1), size)]

    def ask(self, method: str, images, prompts, refinements):
        """Every call's answer, joined in batch order; an actor that died is waited for (Ray restarts
        it) and asked again. A call's answer that is not values (None: no strict measure; a dict: a
        term's mistake, which the caller reports) is the answer."""
        parts = []
        for rows in self.calls(len(prompts)):
            actor = self.actors[self.turn % len(self.actors)]
            self.turn += 1
            args = (None if images is None else images[rows], prompts[rows], refinements[rows])
            parts.append((actor, args, getattr(actor, method).remote(*args)))
        answers = []
        for actor, args, call in parts:
            try:
                values = self.retry(partial(get, call), again=partial(self.ask_again, actor, method, args),
                                    recover=partial(self.wait_ready, actor), name=f"reward {method}", counter=None)
            except RayActorError as error:  # one that Ray restarted could not start again: said in one line
                if (failed := start_failure(error)) is None:
                    raise
                raise RuntimeError(f"reward actor {failed.actor} could not start: {failed.cause}") from None
            answers.append(values)
        odd = [a for a in answers if a is None or isinstance(a, dict)]
        if odd or len(answers) == 1:
            return odd[0] if odd else answers[0]
        return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in answers])

    @staticmethod
    def ask_again(actor, method: str, args: tuple):
        return get(getattr(actor, method).remote(*args))

    @staticmethod
    def wait_ready(actor) -> None:
        get(actor.ready.remote())