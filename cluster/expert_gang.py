"""`ExpertGang`: an expert's rank actors, which the expert group drives as one expert.

An expert of `parallel.ranks` = M > 1 is M actors (`expert/<id>` is rank 0, the leader;
`expert/<id>/rank<r>` the others), each in its own placement bundle, forming one torch.distributed
process group (gloo between CPU processes; between GPUs `cpu:gloo,cuda:nccl`: NCCL for device
tensors, gloo for host ones) whose rendezvous the leader hosts.
Every call that computes goes to every rank; the leader's answer is the expert's (its weights and
snapshots are whole), and the others' answers are awaited for their errors. A gang is formed again
(a new generation of its process group) whenever it is restored: at start, on resume, and after
any rank died or lost a peer mid-call, so a restored gang is always whole. In inline mode, or with
M = 1, the gang is one actor and no process group is formed.
"""
from __future__ import annotations

import torch

from cluster.runtime import Runtime, get
from experts.expert import GangBroken
from experts.parallel import GangSpec, backend_for
from experts.records import ShardedOptimizer, ShardFiles, Snapshot


def rank_name(expert_id: str, rank: int) -> str:
    """The actor name of rank `rank` of expert `expert_id` (rank 0 keeps the expert's own name)."""
    return f"expert/{expert_id}" if rank == 0 else f"expert/{expert_id}/rank{rank}"


class ExpertGang:
    def __init__(self, config, runtime: Runtime, expert_id: str, cls):
        spec = config.expert(expert_id)
        ranks = config.ranks(expert_id)
        self.expert_id, self.config = expert_id, config
        self.ranks = [runtime.spawn_member(cls, config, expert_id, name=rank_name(expert_id, r),
                                           resources=spec.resources) for r in range(ranks)]
        self.leader = self.ranks[0]
        self.generation = 0
        self.nodes: list[str | None] = []  # each rank's node, as of the gang's forming

    @property
    def several(self) -> bool:
        return len(self.ranks) > 1

    def form(self) -> None:
        """A new generation of the ranks' process group (every rank alive: Ray has restarted any
        that died; a restore follows, since a rank rebuilt for the new group starts over)."""
        self.generation += 1
        host, port = get(self.leader.open_gang.remote())
        devices = get([r.device_type.remote() for r in self.ranks])
        if len(set(devices)) > 1:
            raise RuntimeError(f"{self.expert_id}: its ranks hold their models on {devices}; every rank of an "
                               f"expert needs a GPU (experts.{self.expert_id}.resources.num_gpus) or none does")
        backend = backend_for(torch.device(devices[0]))
        spec = GangSpec(host, port, self.generation, len(self.ranks), backend, self.config.cluster.collective_timeout_s)
        get([r.join_gang.remote(spec, i) for i, r in enumerate(self.ranks)])
        self.nodes = get([r.node.remote() for r in self.ranks])

    def check(self) -> None:
        """Raise GangBroken unless every rank is in the current generation (none restarted since)."""
        if self.several and get([r.gang_generation.remote() for r in self.ranks]) != [self.generation] * len(self.ranks):
            raise GangBroken(f"{self.expert_id}: a rank restarted since its gang was formed")

    def wait_alive(self) -> None:
        """Return once every rank answers (raises RayActorError while Ray restarts one)."""
        get([r.info.remote() for r in self.ranks])

    def start(self) -> None:
        """A gang as its config builds it, formed if it has several ranks."""
        if self.several:
            self.wait_alive()
            self.form()

    @property
    def sharded(self) -> bool:
        return self.several and self.config.expert(self.expert_id).parallel.strategy == "fsdp"

    def restore(self, weights, optimizer, info) -> None:
        """Every rank back to a snapshot (each rank its own optimizer shard, if sharded) or a
        checkpoint (whole), in a newly formed gang."""
        self.start()
        shards = optimizer.shards if isinstance(optimizer, ShardedOptimizer) else [optimizer] * len(self.ranks)
        get([r.restore.remote(weights, shard, info) for r, shard in zip(self.ranks, shards)])

    def load_weights(self, weights, info) -> None:
        """Every rank's weights, version and last step from a snapshot, their optimizer state kept."""
        get([r.restore.remote(weights, None, info) for r in self.ranks])

    def update(self, step: int, version: int, *inputs) -> list:
        """Every rank's update call (the leader's first: the expert's stats); the expert group has
        checked the gang whole (`check`) before asking."""
        return [r.update.remote(step, version, *inputs) for r in self.ranks]

    def snapshot(self, with_optimizer: bool = True, with_weights: bool = True) -> tuple[Snapshot, list]:
        """(the expert's snapshot as ObjectRefs: the leader's weights (unless `with_weights` is
        False) and info, and if sharded every rank's optimizer shard (unless `with_optimizer` is
        False); the other ranks' calls to await)."""
        calls = [r.snapshot.options(num_returns=3).remote(with_optimizer, with_weights) for r in self.ranks]
        weights, optimizer, info = calls[0]
        if self.sharded and with_optimizer:
            optimizer = ShardedOptimizer([call[1] for call in calls])
        return Snapshot(weights, optimizer, info), [call[2] for call in calls[1:]]

    def optimizer_files(self, into: str, writer_node: str | None) -> list[ShardFiles]:
        """A sharded gang's optimizer state as every rank writes it for a checkpoint (into the
        checkpoint's folder `into` where a rank shares the writer's node, else into the object
        store): each rank's ShardFiles as ObjectRefs, returned once every rank has written them
        (raising what a rank raised)."""
        parts = [ShardFiles(*r.optimizer_files.options(num_returns=2).remote(into, writer_node)) for r in self.ranks]
        get([part.param_groups for part in parts])
        return parts

    def actors(self) -> list:
        return list(self.ranks)
