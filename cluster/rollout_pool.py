"""`RolloutPool`: the rollout workers as the driver sees them — rollouts submitted ahead, each made
under the weights it names, a lost one made again, and a step's shards collected into one.

With `cluster.max_staleness=k` the rollouts of steps t+1..t+k are already submitted while step t
updates. Each rollout names the versions published when it was submitted, and a worker holds every
version a rollout in flight may still name, so a publish that reaches a worker first (it comes from
the weight-sync actor, another caller) never changes the weights of a rollout submitted before.
A worker that dies is restarted by Ray, loaded with the weights its rollout was made with and given
its share again: a rollout is a pure function of step and weights.
"""
from __future__ import annotations

import math
from functools import partial

from cluster.recovery import FaultCounts, NotSynced, settle
from cluster.rollout_worker import RolloutWorker
from cluster.rollouts import Rollout, Rollouts, shares
from cluster.runtime import Runtime, get
from experts.pipeline import RolloutMeta, RolloutOutputs
from experts.records import Release
from experts.weights import fingerprint


class RolloutPool(Rollouts):
    """The separate layout's rollouts: `cluster.rollout_workers` workers, each holding a copy of
    every expert's weights that the weight-sync actor keeps at the versions published."""

    @staticmethod
    def rollout_seconds(*, refine: dict[str, float], generate: float, samples: int, refined: int,
                        ranks: dict[str, int], workers: int) -> float:
        """Each worker refines its share with every refiner, then generates it."""
        return sum(refine.values()) * math.ceil(refined / workers) + generate * math.ceil(samples / workers)

    @staticmethod
    def who_rolls_out(*, generator_ranks: int, workers: int) -> str:
        return f"the generator on {generator_ranks} rank(s) + {workers} rollout worker(s)"

    def __init__(self, config, runtime: Runtime, faults: FaultCounts, plan):
        super().__init__(config, runtime, faults, plan)
        self.reloaded = False  # a worker was given older weights to redo a rollout: publish all after the step

    def spawn_workers(self) -> list:
        return [self.runtime.spawn_member(RolloutWorker, self.config, j, self.runtime.members, name=f"rollout/{j}",
                                          resources=self.config.cluster.rollout_resources)
                for j in range(self.config.cluster.rollout_workers)]

    def submit(self, step: int, experts) -> None:
        """Every worker's share of `step`'s samples, made with the weights `experts` published so far."""
        samples = self.plan(step)
        worker_shares = shares(samples, len(self.workers))
        rollout = self.in_flight[step] = Rollout(samples, worker_shares, [], dict(experts.published))
        rollout.outputs = [self.submit_share(worker, step, share, rollout.versions)
                           for worker, share in zip(self.workers, worker_shares)]

    def submit_share(self, worker, step: int, share: list, versions: dict[str, int]) -> RolloutOutputs:
        """One worker's share of a step, made with `versions`: its outputs as separate refs."""
        meta, trajectories, *tokens = worker.rollout.options(num_returns=2 + len(self.refiner_ids)).remote(
            step, share, versions)
        return RolloutOutputs(meta, trajectories, dict(zip(self.refiner_ids, tokens)))

    def submit_under(self, step: int, weights: dict[str, Release], experts) -> None:
        """`step`'s rollout made again with the `weights` it was first made with: the workers get
        the ones that changed since, then what they held before."""
        held = dict(experts.published)
        changed = {e: w for e, w in weights.items() if w.version != held[e].version}
        experts.deliver(changed)
        self.submit(step, experts)
        experts.deliver({e: held[e] for e in changed})

    def look_ahead(self, step: int, experts) -> None:
        """Rollouts in flight for `step` and up to `cluster.max_staleness` steps after it."""
        last = min(step + self.config.cluster.max_staleness, self.config.trainer.steps - 1)
        for s in range(step, last + 1):
            if s not in self.in_flight:
                self.submit(s, experts)

    def resubmit(self, saved: dict[int, dict[str, tuple]], start_step: int, experts) -> None:
        """The rollouts a checkpoint had in flight, each made again with the older weights it was
        made with ({step: {expert: (version, weights)}}), so that a resumed run equals the
        uninterrupted one. Those beyond this run's `max_staleness` are left to `look_ahead`."""
        for s in sorted(saved):
            if s - start_step < self.config.cluster.max_staleness:
                older = {e: Release(v, self.runtime.put(w), fingerprint(w)) for e, (v, w) in saved[s].items()}
                self.submit_under(s, {**experts.published, **older}, experts)

    def collect(self, step: int, experts) -> Rollout:
        """`step`'s rollout (submitted now if it was not already, with the look-ahead after it), its
        shares' metadata joined. A worker that died is restarted by Ray, loaded with the weights
        the rollout was made with and given its share again."""
        self.look_ahead(step, experts)
        rollout = self.in_flight.pop(step)
        rollout.meta = RolloutMeta.join([
            self.retry(partial(self.share_meta, rollout, j), again=partial(self.share_again, step, rollout, j),
                       recover=partial(self.reload, worker, rollout.weights), retried=(NotSynced,),
                       name=f"rollout worker {j}, step {step}", counter="worker_restarts")
            for j, worker in enumerate(self.workers)])
        return rollout

    @staticmethod
    def share_meta(rollout: Rollout, j: int) -> RolloutMeta:
        return get(rollout.outputs[j].meta)

    def share_again(self, step: int, rollout: Rollout, j: int) -> RolloutMeta:
        """Worker `j`'s share of `rollout` submitted again (its earlier outputs' errors taken)."""
        settle([rollout.outputs[j].trajectories, *rollout.outputs[j].tokens.values()])
        rollout.outputs[j] = self.submit_share(self.workers[j], step, rollout.shares[j], rollout.versions)
        return self.share_meta(rollout, j)

    def reload(self, worker, weights: dict[str, Release]) -> None:
        """A restarted `worker` given the `weights` a rollout is made with."""
        self.reloaded = True
        get([worker.load_weights.remote(e, *release) for e, release in weights.items()])

    def remake(self, step: int, rollout: Rollout, experts) -> Rollout:
        """`rollout` made again under the weights it was made with (its outputs were lost)."""
        self.submit_under(step, rollout.weights, experts)
        return self.collect(step, experts)

    def take_reloaded(self) -> bool:
        """Whether a worker was given older weights since the last call: then every expert is
        published again, so that every worker serves the latest versions."""
        reloaded, self.reloaded = self.reloaded, False
        return reloaded

    def older_weights(self, versions: dict[str, int]) -> dict[int, dict[str, tuple]]:
        """{step: {expert: (version, weights as an ObjectRef)}}: the weights older than `versions`
        that the rollouts in flight were made with (a checkpoint keeps them)."""
        return {s: {e: (w.version, w.weights) for e, w in r.weights.items() if w.version != versions[e]}
                for s, r in self.in_flight.items()}

    def evaluate(self) -> dict:
        """The task's evaluation report, made by the first worker with the weights it serves now."""
        return get(self.workers[0].evaluation.remote())
