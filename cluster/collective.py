"""Weight sync by collective broadcast (`cluster.sync=collective`), for weights that live on GPUs.

Each expert broadcasts its new weights from its own tensors straight into every rollout worker's
with torch.distributed (`cluster.collective_backend`: NCCL between GPUs, gloo between CPU
processes), so GPU weights never make a round trip through host memory and the object store. It
sits behind the object-store path's interface: the weight-sync actor publishes (expert, version,
fingerprint), every worker checks the fingerprint and acknowledges the version.

The run's experts and workers form one process group, whose rendezvous is a TCPStore hosted by
the weight-sync actor; each expert has a subgroup of itself and every worker, so its broadcast
reaches only them. A restarted actor is a new process outside the group: its generation is not
the current one, and the sync actor forms the group anew before the next broadcast.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from experts.parallel import join_group


@dataclass(frozen=True)
class GroupSpec:
    """Everything a process needs to join generation `generation` of the run's broadcast group.
    `subgroups`: per expert, its ranks, the expert's own first."""
    host: str
    port: int
    generation: int
    world_size: int
    subgroups: dict[str, list[int]]
    backend: str
    timeout_s: float


def layout(tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple, torch.dtype, torch.device]]:
    """(name, shape, dtype, device) of every tensor, in name order: what sender and receiver agree on."""
    return [(k, tuple(tensors[k].shape), tensors[k].dtype, tensors[k].device) for k in sorted(tensors)]


def buffer_sizes(plan: list[tuple]) -> dict[tuple, int]:
    """Elements of the flat buffer per (dtype, device), in order of first appearance."""
    sizes: dict[tuple, int] = {}
    for _, shape, dtype, device in plan:
        sizes[(dtype, device)] = sizes.get((dtype, device), 0) + math.prod(shape)
    return sizes


def flatten(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in name order, joined into one flat buffer per (dtype, device): one broadcast each."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for name, _, dtype, device in layout(tensors):
        groups.setdefault((dtype, device), []).append(tensors[name].detach().reshape(-1))
    return [torch.cat(parts) for parts in groups.values()]


def unflatten(buffers: list[torch.Tensor], plan: list[tuple]) -> dict[str, torch.Tensor]:
    """Views of `buffers` (from `flatten`) as the named tensors of `plan`."""
    offsets = {key: 0 for key in buffer_sizes(plan)}
    flat = dict(zip(offsets, buffers))
    out = {}
    for name, shape, dtype, device in plan:
        start, n = offsets[(dtype, device)], math.prod(shape)
        out[name] = flat[(dtype, device)][start:start + n].view(shape)
        offsets[(dtype, device)] = start + n
    return out


class BroadcastGroup:
    """This process's place in one generation of the run's broadcast group."""

    def __init__(self, spec: GroupSpec, rank: int):
        if spec.backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("cluster.collective_backend=nccl needs a GPU in every expert and rollout "
                               "worker; use gloo (CPU weights) or cluster.sync=object_store")
        join_group(spec.host, spec.port, f"generation-{spec.generation}", rank, spec.world_size, spec.backend,
                   spec.timeout_s)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        # every rank takes part in creating every subgroup, in the same order
        self.groups = {e: dist.new_group(ranks, backend=spec.backend, timeout=timeout)
                       for e, ranks in spec.subgroups.items()}
        self.sources = {e: ranks[0] for e, ranks in spec.subgroups.items()}
        self.rank, self.generation = rank, spec.generation

    def send(self, expert_id: str, tensors: dict[str, torch.Tensor]) -> None:
        for buffer in flatten(tensors):
            dist.broadcast(buffer, src=self.rank, group=self.groups[expert_id])

    def receive(self, expert_id: str, plan: list[tuple]) -> dict[str, torch.Tensor]:
        """Fresh tensors of `plan`'s layout, filled by `expert_id`'s broadcast."""
        buffers = [torch.empty(n, dtype=dtype, device=device) for (dtype, device), n in buffer_sizes(plan).items()]
        for buffer in buffers:
            dist.broadcast(buffer, src=self.sources[expert_id], group=self.groups[expert_id])
        return unflatten(buffers, plan)


class BroadcastMember:
    """What an expert or rollout worker needs to be in the broadcast group (a mixin of both actors)."""
    broadcast_group: BroadcastGroup | None = None

    def join_broadcast(self, spec: GroupSpec, rank: int) -> int:
        self.broadcast_group = None  # drop the old generation's groups before their process group goes
        self.broadcast_group = BroadcastGroup(spec, rank)
        return spec.generation

    def broadcast_generation(self) -> int | None:
        """The generation this process is in: None in a new (restarted) process."""
        return self.broadcast_group.generation if self.broadcast_group else None
