"""`RolloutWorker`: a rollout pipeline (experts/pipeline.py) as a Ray actor that serves versions.

Weights arrive from the weight-sync actor (another caller than the driver, so a delivery may
overtake a rollout submitted before it) and change only between rollouts. A rollout names the
versions it must be made with; the worker holds every version a rollout in flight may still name,
so every sample is made by exactly the version vector its rollout named.
"""
from __future__ import annotations

import torch

from cluster.collective import BroadcastMember
from cluster.recovery import NotSynced, this_node
from cluster.reward_pool import PooledTerm, pool_names
from cluster.runtime import Members
from experts.devices import actor_device
from experts.pipeline import RolloutPipeline
from experts.weights import fingerprint, model_tensors, travel_layout
from tasks.evaluation import evaluate_sets


class CorruptWeights(RuntimeError):
    """Weights whose fingerprint does not match the one they were published with."""


class RolloutWorker(RolloutPipeline, BroadcastMember):
    def __init__(self, config, index: int, members: Members | None = None):
        """The terms with a pool of reward actors (cluster/reward_pool.py) are scored by them,
        found among the run's `members`; the other terms are scored here."""
        torch.set_num_threads(1)
        pools = pool_names(config)
        if pools and members is None:
            raise ValueError(f"rollout/{index}: reward.terms {sorted(pools)} are scored by reward actors; "
                             f"a worker needs the run's members to find them")
        scorers = {term: PooledTerm([members(name) for name in names], index, config.cluster.max_restarts)
                   for term, names in pools.items()}
        super().__init__(config, scorers, actor_device(config.cluster.rollout_resources))
        self.index = index
        self.held: dict[str, dict[int, dict]] = {eid: {} for eid in self.models}  # expert -> version -> tensors

    def load_weights(self, expert_id: str, version: int, weights: dict, checksum: int | None = None) -> int:
        """Serve `version` of `expert_id` from now on; `weights` (travelled arrays) must match
        `checksum` if given. With `cluster.share_weights` the model reads them where they lie
        (read-only views of the object store, shared by every worker on the node); else it copies them."""
        return self.serve(expert_id, version, weights, checksum, self.config.cluster.share_weights)

    def receive_weights(self, expert_id: str, version: int, checksum: int) -> int:
        """Serve `version` of `expert_id`, received from the expert's broadcast (`cluster.sync=collective`)."""
        plan = travel_layout(self.models[expert_id])  # the expert's dtypes (fp32 where it trains a bf16 model)
        return self.serve(expert_id, version, self.broadcast_group.receive(expert_id, plan), checksum, share=True)

    def serve(self, expert_id: str, version: int, weights: dict, checksum: int | None, share: bool) -> int:
        """Hold `weights` as `version` once they match `checksum`, and serve them if no newer version
        is being served; returns `version`."""
        if checksum is not None and fingerprint(weights) != checksum:
            raise CorruptWeights(f"rollout/{self.index}: {expert_id} v{version} does not match its fingerprint")
        self.held[expert_id][version] = model_tensors(self.models[expert_id], weights, share)
        if self.versions[expert_id] is None or version >= self.versions[expert_id]:
            self.use(expert_id, version)
        return version

    def use(self, expert_id: str, version: int) -> None:
        """Serve the held `version` of `expert_id`."""
        if self.versions[expert_id] != version:
            self.load(expert_id, version, self.held[expert_id][version])

    def use_versions(self, versions: dict[str, int]) -> None:
        """Serve exactly `versions`, and forget held versions older than them: later rollouts,
        submitted in step order, never ask for those again (a redone one has them delivered anew)."""
        missing = {e: v for e, v in versions.items() if v is None or v not in self.held[e]}
        if missing:
            raise NotSynced(f"rollout/{self.index} does not hold {missing}; sync first")
        for expert_id, version in versions.items():
            self.use(expert_id, version)
            self.held[expert_id] = {v: w for v, w in self.held[expert_id].items() if v >= version}

    def evaluation(self) -> dict:
        """The task's evaluation (tasks/evaluation.py) with the weights served now."""
        return evaluate_sets(self.config, self)

    def rollout(self, step: int, samples: list, versions: dict[str, int] | None = None) -> tuple:
        """`samples` made with the experts' `versions` (None: those served now), returned as
        separate objects (meta, trajectories, then each refiner's token batch in refiner order),
        so that each expert fetches only what it learns from."""
        self.use_versions(versions or dict(self.versions))
        out = self.run(step, samples)
        return (out.meta, out.trajectories, *[out.tokens[e] for e in self.refiner_ids])

    def node(self) -> str | None:
        """The Ray node this worker runs on now (it may move when Ray restarts it)."""
        return this_node()
