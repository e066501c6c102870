"""`RolloutWorker`: a rollout pipeline (experts/pipeline.py) as a Ray actor that serves versions.

Weights arrive from the weight-sync actor (another caller than the driver, so a delivery may
overtake a rollout submitted before it) in a concurrency group of their own (`DELIVERY`): a
delivery never waits behind a running rollout (an NCCL broadcast waiting on one would time out),
it only holds the weights it brings. The weights served change only in the default group, which
runs the rollouts one at a time, so only between rollouts. A rollout names the versions it must be
made with; the worker holds every version a rollout in flight may still name, so every sample is
made by exactly the version vector its rollout named.
"""
from __future__ import annotations

import os
import sys
import threading

import ray
import torch

from cluster.collective import BroadcastMember, GroupSpec, layout
from cluster.recovery import NotSynced, this_node
from cluster.reward_pool import pooled_scorers
from cluster.runtime import Members
from cluster.startup import reports_start
from experts.devices import actor_device
from experts.pipeline import RolloutPipeline
from experts.vllm_refiner import EngineLoadError
from experts.weights import fingerprint, model_tensors, travelled
from tasks.evaluation import evaluate_sets


class CorruptWeights(RuntimeError):
    """Weights whose fingerprint does not match the one they were published with."""


DELIVERY = "delivery"  # the concurrency group weights are delivered in, beside the default one


class RolloutWorker(RolloutPipeline, BroadcastMember):
    CONCURRENCY_GROUPS = {DELIVERY: 1}  # the actor's groups besides the default one (cluster/runtime.py)

    @reports_start
    def __init__(self, config, index: int, members: Members | None = None):
        """The terms with a pool of reward actors (cluster/reward_pool.py) are scored by them,
        found among the run's `members`; the other terms are scored here."""
        torch.set_num_threads(1)
        super().__init__(config, pooled_scorers(config, members, index, f"rollout/{index}"),
                         actor_device(config.cluster.rollout_resources))
        self.index = index
        self.held: dict[str, dict[int, dict]] = {eid: {} for eid in self.models}  # expert -> version -> tensors
        self.pinned: dict[str, set[int]] = {eid: set() for eid in self.models}  # older versions, for a redone rollout
        self.wanted: dict[str, int | None] = {eid: None for eid in self.models}  # the newest delivered
        self.state = threading.Lock()  # held, pinned and wanted: read and written by both groups
        self.busy = threading.Lock()  # taken by a rollout (or evaluation) for its whole run

    @ray.method(concurrency_group=DELIVERY)
    def load_weights(self, expert_id: str, version: int, weights: dict, checksum: int | None = None) -> int:
        """Hold `version` of `expert_id`; `weights` (travelled arrays) must match `checksum` if given.
        With `cluster.share_weights` the model reads them where they lie (read-only views of the
        object store, shared by every worker on the node); else it copies them."""
        return self.serve(expert_id, version, weights, checksum, share=self.config.cluster.share_weights)

    @ray.method(concurrency_group=DELIVERY)
    def receive_weights(self, expert_id: str, version: int, checksum: int) -> int:
        """Hold `version` of `expert_id`, received from the expert's broadcast (`cluster.sync=collective`)."""
        plan = layout(travelled(self.models[expert_id]))  # the expert's dtypes (fp32 where it trains a bf16 model)
        return self.serve(expert_id, version, self.broadcast_group.receive(expert_id, plan), checksum, share=True)

    @ray.method(concurrency_group=DELIVERY)
    def join_broadcast(self, spec: GroupSpec, rank: int) -> int:
        return BroadcastMember.join_broadcast(self, spec, rank)

    @ray.method(concurrency_group=DELIVERY)
    def broadcast_generation(self) -> int | None:
        return BroadcastMember.broadcast_generation(self)

    @ray.method(concurrency_group=DELIVERY)
    def broadcast_device(self) -> tuple | None:
        return BroadcastMember.broadcast_device(self)

    def serve(self, expert_id: str, version: int, weights: dict, checksum: int | None, *, share: bool) -> int:
        """Hold `weights` as `version` once they match `checksum`, and serve it between rollouts if it
        is the newest delivered: at once if no rollout is running, else once it is over (the next
        call that reads what is served catches up); returns `version`. A version older than one
        held is kept until a rollout names it (it was delivered for a rollout made again)."""
        if checksum is not None and fingerprint(weights) != checksum:
            raise CorruptWeights(f"rollout/{self.index}: {expert_id} v{version} does not match its fingerprint")
        tensors = model_tensors(self.models[expert_id], weights, share)
        with self.state:
            held, wanted = self.held[expert_id], self.wanted[expert_id]
            if held and version < max(held):
                self.pinned[expert_id].add(version)
            held[version] = tensors
            if wanted is None or version >= wanted:
                self.wanted[expert_id] = version
        if self.busy.acquire(blocking=False):  # no rollout is running: serve it now
            try:
                self.catch_up()
            finally:
                self.busy.release()
        return version

    def wanted_now(self) -> dict[str, int | None]:
        with self.state:
            return dict(self.wanted)

    def version_vector(self) -> dict:
        """The versions served: the newest delivered, caught up to here, unless a rollout is running
        (inside one, the versions it is made with)."""
        if self.busy.acquire(blocking=False):
            try:
                self.catch_up()
            finally:
                self.busy.release()
        return super().version_vector()

    def catch_up(self) -> None:
        """Serve the newest version delivered of every expert (under `busy`), forgetting none: a
        rollout submitted before it was delivered may still name an older one."""
        for expert_id, version in self.wanted_now().items():
            if version is not None:
                self.use(expert_id, version)

    def use(self, expert_id: str, version: int) -> None:
        """Serve the held `version` of `expert_id` (under `busy`: no rollout is running). An engine
        that fails to take it may be left broken: the worker says so and exits, to be restarted
        and given its weights again as a lost worker is."""
        if self.versions[expert_id] != version:
            with self.state:
                tensors = self.held[expert_id][version]
            try:
                self.load(expert_id, version, tensors)
            except EngineLoadError as error:
                print(f"rollout/{self.index}: {error} (v{version}); the worker exits to be restarted",
                      file=sys.stderr, flush=True)
                os._exit(1)

    def use_versions(self, versions: dict[str, int | None]) -> None:
        """Serve exactly `versions` (under `busy`), and forget held versions older than them: later
        rollouts, submitted in step order, never ask for those again (a redone one has them
        delivered anew, and kept: `serve`)."""
        with self.state:
            missing = {e: v for e, v in versions.items() if v is None or v not in self.held[e]}
        if missing:
            raise NotSynced(f"rollout/{self.index} does not hold {missing}; sync first")
        for expert_id, version in versions.items():
            self.use(expert_id, version)
        with self.state:
            for expert_id, version in versions.items():
                self.pinned[expert_id].discard(version)
                self.held[expert_id] = {v: w for v, w in self.held[expert_id].items()
                                        if v >= version or v in self.pinned[expert_id]}

    def evaluation(self) -> dict:
        """The task's evaluation (tasks/evaluation.py) with the newest weights delivered."""
        with self.busy:
            self.catch_up()
            return evaluate_sets(self.config, self)

    def rollout(self, step: int, samples: list, versions: dict[str, int] | None = None) -> tuple:
        """`samples` made with the experts' `versions` (None: the newest delivered), returned as
        separate objects (meta, trajectories, then each refiner's token batch in refiner order),
        so that each expert fetches only what it learns from."""
        with self.busy:
            self.use_versions(versions or self.wanted_now())
            out = self.run(step, samples)
        return (out.meta, out.trajectories, *[out.tokens[e] for e in self.refiner_ids])

    def node(self) -> str | None:
        """The Ray node this worker runs on now (it may move when Ray restarts it)."""
        return this_node()
