"""`ExpertActor`: an expert (experts/expert.py) as a Ray actor, or one rank of it.

The shell adds what only an actor has: the device Ray gave it, the node it runs on, its place in
the broadcast group (`cluster.sync=collective`), its rollouts under `cluster.layout=colocated`
(cluster/colocated_rank.py) and, for an expert of several ranks, the leader's
rendezvous of their process group (cluster/expert_gang.py). In a Ray actor its weights leave as
views, which Ray copies into the object store once as the method returns; in-process (inline)
they are copied, or a later update would change a snapshot already taken.
"""
from __future__ import annotations

import ray
import torch
import torch.distributed as dist

from cluster.collective import BroadcastMember
from cluster.colocated_rank import ColocatedRank
from cluster.recovery import in_ray_actor, this_node
from cluster.startup import reports_start
from experts.devices import actor_device
from experts.expert import Expert, StaleExpert
from experts.records import ShardFiles
from experts.weights import synced_state, travel_form


class ExpertActor(ColocatedRank, Expert, BroadcastMember):
    @reports_start
    def __init__(self, config, expert_id: str):
        torch.set_num_threads(1)
        spec = config.expert(expert_id)
        device = actor_device(spec.resources)
        sharded = spec.parallel.ranks > 1 and spec.parallel.strategy == "fsdp"
        # a sharded expert's model stays on the CPU until it is sharded onto the device
        super().__init__(config, expert_id, torch.device("cpu") if sharded else device, private=not in_ray_actor())
        self.device = device
        self.rendezvous: dist.TCPStore | None = None

    def open_gang(self) -> tuple[str, int]:
        """The (host, port) of the rendezvous of the expert's ranks, which the leader hosts (one
        store for every generation of the gang: each joins under its own prefix)."""
        if self.rendezvous is None:
            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            self.rendezvous = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return self.rendezvous.host, self.rendezvous.port

    def device_type(self) -> str:
        """Where this rank keeps its model ("cuda" or "cpu"): its gang's backend follows from it."""
        return self.device.type

    def send_weights(self, version: int) -> None:
        """Broadcast this expert's weights, at `version`, into every rollout worker (`cluster.sync=collective`)."""
        if version != self.version:
            raise StaleExpert(f"{self.expert_id} is at version {self.version}, asked to send version {version}")
        self.broadcast_group.send(self.expert_id, travel_form(synced_state(self.model)))

    def node(self) -> str | None:
        """The Ray node this expert runs on now (it may move when Ray restarts it)."""
        return this_node()

    def optimizer_files(self, into: str | None = None, writer_node: str | None = None) -> ShardFiles:
        """`Expert.optimizer_files`: straight into the checkpoint's folder `into` where this rank
        runs on the node of the checkpoint's writer (`writer_node`), else handed over through the
        object store."""
        return Expert.optimizer_files(self, into if writer_node == this_node() else None)
