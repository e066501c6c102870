"""`ColocatedRollouts`: a step's rollout made by the experts' own ranks (`cluster.layout=colocated`).

There are no rollout workers. Each refiner's ranks refine their contiguous share of the step's
refined samples with the weights they train; the generator's ranks then sample their share of all
the samples from those refinements, decode them and have them scored (reward terms with actors are
asked there, the others score in the generator's ranks), and the same ranks update afterwards, so
no weight copy travels between versions. The driver moves the refinements (text) and ObjectRefs:
each refiner's token batches and the generator's trajectories stay in the object store for their
own expert's update. A rollout is a pure function of the step and the weights (experts/pipeline.py),
so it equals the separate layout's sample for sample. A rank that dies is restored with its gang
from the expert's last snapshot (the version the rollout is made with) and its share made again.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from functools import partial

import numpy as np

from cluster.rollouts import Rollout, Rollouts, shares
from cluster.runtime import get
from experts.expert import GangBroken, StaleExpert
from experts.pipeline import RolloutMeta, RolloutOutputs


def fetched(fetch, calls) -> tuple:
    return fetch(calls), calls


def refinements_of(calls: list[tuple]) -> list:
    """A refiner's ranks' refinements, from their (refinements, token batch) calls."""
    return get([made for made, _ in calls])


def metas_of(outputs: list[RolloutOutputs]) -> list[RolloutMeta]:
    return get([o.meta for o in outputs])


class ColocatedRollouts(Rollouts):
    """The driver's rollouts under `cluster.layout=colocated`: made of the experts' ranks (through
    the expert group) instead of rollout workers. The weight-sync actor has no one to deliver to,
    and nothing is ever in flight: a step is rolled out when it starts."""

    experts_roll_out = True

    @staticmethod
    def rollout_seconds(*, refine: dict[str, float], generate: float, samples: int, refined: int,
                        ranks: dict[str, int], workers: int) -> float:
        """Each refiner's ranks refine their share (the refiners at once), then the generator's
        ranks generate theirs."""
        refining = max((cost * math.ceil(refined / ranks[e]) for e, cost in refine.items()), default=0.0)
        return refining + generate * math.ceil(samples / ranks["generator"])

    @staticmethod
    def who_rolls_out(*, generator_ranks: int, workers: int) -> str:
        return f"the generator on {generator_ranks} rank(s)"

    def collect(self, step: int, experts) -> Rollout:
        """`step`'s rollout, made now by the experts' ranks with the versions they hold."""
        start = time.perf_counter()
        samples = self.plan(step)
        rollout = Rollout(samples, [], [], dict(experts.published))
        self.make(step, rollout, experts, self.refiner_ids, generate=True)
        rollout.meta = replace(RolloutMeta.join(get([o.meta for o in rollout.outputs])),
                               busy_s=time.perf_counter() - start)
        return rollout

    def make(self, step: int, rollout: Rollout, experts, refiners: list[str], *, generate: bool) -> None:
        """The rollout's token batches of `refiners` (their refinements kept in the rollout), all
        refining at once, then, if `generate`, the generator's shares from every refinement kept."""
        experts.make_whole([*refiners, *(["generator"] if generate else [])])
        refined = [s for s in rollout.samples if s.refine]
        rows = [i for i, s in enumerate(rollout.samples) if s.refine]
        submit = {e: partial(self.refine, step, e, refined, experts) for e in refiners}
        calls = {e: submit[e]() for e in refiners}
        rollout.refinements = rollout.refinements or [{} for _ in rollout.samples]
        for e in refiners:
            made, calls[e] = self.survived(experts, e, calls[e], submit[e], fetch=refinements_of)
            rollout.tokens[e] = [tokens for _, tokens in calls[e]]
            for i, refinement in zip(rows, (r for share in made for r in share)):
                rollout.refinements[i][e] = refinement
        if generate:
            submit = partial(self.generate, step, rollout, experts)
            _, rollout.outputs = self.survived(experts, "generator", submit(), submit, fetch=metas_of)

    def refine(self, step: int, e: str, refined: list, experts) -> list[tuple]:
        """Refiner `e`'s ranks' calls refining their shares of `refined`: per rank (its refinements,
        its token batch), as ObjectRefs."""
        gang = experts.gangs[e]
        return [rank.refine.options(num_returns=2).remote(step, experts.versions[e], share)
                for rank, share in zip(gang.ranks, shares(refined, len(gang.ranks)))]

    def generate(self, step: int, rollout: Rollout, experts) -> list[RolloutOutputs]:
        """The generator's ranks' calls rolling out their shares of the samples, from the rollout's
        refinements: each share's outputs as ObjectRefs."""
        gang = experts.gangs["generator"]
        rollout.shares = shares(rollout.samples, len(gang.ranks))
        cut = np.cumsum([0, *map(len, rollout.shares)])
        return [RolloutOutputs(*rank.roll_out.options(num_returns=3).remote(
            step, experts.versions["generator"], share, rollout.refinements[cut[j]:cut[j + 1]],
            versions=dict(experts.versions), members=self.runtime.members))
            for j, (rank, share) in enumerate(zip(gang.ranks, rollout.shares))]

    def survived(self, experts, e: str, calls, submit, *, fetch):
        """`fetch(calls)`, with `calls = submit()` made again on expert `e`'s gang restored from its
        last snapshot if a rank died (or lost a peer) meanwhile: the same version, so the same
        result. Returns (what `fetch` returns, the calls it was fetched from)."""
        return self.retry(partial(fetched, fetch, calls), again=partial(self.made_again, experts, e, submit, fetch),
                          recover=partial(experts.wait_alive, e), retried=(GangBroken, StaleExpert),
                          name=f"{e}'s rollout share", counter="expert_restarts")

    @staticmethod
    def made_again(experts, e: str, submit, fetch) -> tuple:
        """`submit()`'s calls fetched, on expert `e`'s gang restored from its last snapshot."""
        experts.restore(e)
        return fetched(fetch, submit())

    def remake(self, step: int, rollout: Rollout, experts) -> Rollout:
        """`rollout`'s outputs made again after they were lost with a node, for the experts not yet
        updated this step (they still hold the versions it was made with): the generator's shares
        from the refinements kept, a refiner's token batches anew (the same tokens)."""
        stale = [e for e in rollout.versions if experts.versions[e] == rollout.versions[e]]
        self.make(step, rollout, experts, [e for e in self.refiner_ids if e in stale], generate="generator" in stale)
        return rollout

    def resubmit(self, saved: dict, start_step: int, experts) -> None:
        """A checkpoint's rollouts in flight (made by an asynchronous separate run) are not made
        again: every step here is rolled out when it starts, with the weights held then."""

    def take_reloaded(self) -> bool:
        """No one is ever given older weights: there is nothing to publish again."""
        return False

    def older_weights(self, versions: dict[str, int]) -> dict:
        """No rollout is in flight between steps: a checkpoint keeps no older weights."""
        return {}

    def evaluate(self) -> dict:
        raise NotImplementedError("evaluation during training needs rollout workers (cluster.layout=separate); the "
                                  "config refuses evaluation.every with cluster.layout=colocated")
