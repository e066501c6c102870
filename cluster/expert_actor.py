"""`ExpertActor`: an expert (experts/expert.py) as a Ray actor.

The shell adds what only an actor has: the device Ray gave it, the node it runs on, and its place
in the broadcast group (`cluster.sync=collective`). In a Ray actor its weights leave as views, which
Ray copies into the object store once as the method returns; in-process (inline) they are copied,
or a later update would change a snapshot already taken.
"""
from __future__ import annotations

import torch

from cluster.collective import BroadcastMember
from cluster.recovery import in_ray_actor, this_node
from experts.devices import actor_device
from experts.expert import Expert, StaleExpert
from experts.weights import synced_state, travel_form


class ExpertActor(Expert, BroadcastMember):
    def __init__(self, config, expert_id: str):
        torch.set_num_threads(1)
        super().__init__(config, expert_id, actor_device(config.expert(expert_id).resources),
                         private=not in_ray_actor())

    def send_weights(self, version: int) -> None:
        """Broadcast this expert's weights, at `version`, into every rollout worker (`cluster.sync=collective`)."""
        if version != self.version:
            raise StaleExpert(f"{self.expert_id} is at version {self.version}, asked to send version {version}")
        self.broadcast_group.send(self.expert_id, travel_form(synced_state(self.model)))

    def node(self) -> str | None:
        """The Ray node this expert runs on now (it may move when Ray restarts it)."""
        return this_node()
