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

A version travels as one flat byte buffer on the group's device (a GPU under NCCL, the host under
gloo), whatever the sender's and receivers' own devices: NCCL carries no int16 (the words bfloat16
weights travel as; pytorch's ProcessGroupNCCL.cpp maps no at::kShort in `ncclDataType`) and takes
no host tensor, and every member must agree on what each broadcast carries. NCCL also refuses two
members on one GPU, so such a group is refused before it is formed (`refuse_shared_gpus`).
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist

from cluster.recovery import this_node
from common.config import SettingError
from experts.parallel import backend_for, join_group

ALIGN = 16  # bytes: every tensor starts at a multiple of this in the buffer, so its view is aligned


class CollectiveRefused(SettingError):
    """A broadcast group that cannot work, said once instead of falling back every step."""
    config_key = "cluster.sync"


@dataclass(frozen=True)
class GroupSpec:
    """Everything a process needs to join generation `generation` of the run's broadcast group.
    `subgroups`: per expert, its ranks, the expert's own first. `backend`: `cluster.collective_backend`."""
    host: str
    port: int
    generation: int
    world_size: int
    subgroups: dict[str, list[int]]
    backend: str
    timeout_s: float

    @property
    def device(self) -> torch.device:
        """Where the broadcast buffers live: the GPU of each member under NCCL, else the host."""
        return torch.device("cuda" if self.backend == "nccl" else "cpu")


def layout(tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple, torch.dtype, int]]:
    """(name, shape, dtype, byte offset in the buffer) of every tensor, in name order: what sender and
    receivers agree on."""
    plan, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        plan.append((name, tuple(t.shape), t.dtype, offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return plan


def buffer_bytes(plan: list[tuple]) -> int:
    """The size of the flat buffer of `plan`."""
    if not plan:
        return 0
    _, shape, dtype, offset = plan[-1]
    return offset + math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def flatten(tensors: dict[str, torch.Tensor], device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The tensors' bytes in one flat uint8 buffer on `device`, laid out as `layout` says: one broadcast."""
    plan = layout(tensors)
    buffer = torch.empty(buffer_bytes(plan), dtype=torch.uint8, device=device)
    for name, _, _, offset in plan:
        raw = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + raw.numel()].copy_(raw)
    return buffer


def unflatten(buffer: torch.Tensor, plan: list[tuple]) -> dict[str, torch.Tensor]:
    """Views of `buffer` (from `flatten`) as the named tensors of `plan`."""
    out = {}
    for name, shape, dtype, offset in plan:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out[name] = buffer[offset:offset + n].view(dtype).view(shape)
    return out


def refuse_shared_gpus(backend: str, members: dict[str, tuple | None]) -> None:
    """Raise CollectiveRefused, naming `cluster.sync`, if the group is NCCL's and two members hold
    one GPU. `members`: per member, (its node, the GPU ids Ray gave it), or None without a GPU."""
    if backend != "nccl":
        return
    holders: dict[tuple, str] = {}
    for name, device in members.items():
        node, ids = device or (None, ())
        for gpu in ids:
            other = holders.setdefault((node, gpu), name)
            if other != name:
                raise CollectiveRefused(
                    f"cluster.sync=collective with cluster.collective_backend=nccl: {other} and {name} share GPU "
                    f"{gpu} on node {node}, and NCCL refuses two members of a group on one GPU. Give every expert "
                    f"and rollout worker a GPU of its own (whole GPUs: experts.<id>.resources.num_gpus=1, "
                    f"cluster.rollout_resources.num_gpus=1) or set cluster.sync=object_store.")


def refused(error: BaseException) -> CollectiveRefused:
    """The refusal to raise for NCCL's invalid-usage error (experts/parallel.py: `nccl_misused`),
    which a group on shared GPUs, or any other misuse, gives every time it is formed."""
    return CollectiveRefused(f"cluster.sync=collective: NCCL refused the broadcast group as invalid usage "
                             f"({str(error).strip().splitlines()[-1]}), as it does for two members on one GPU. "
                             f"Give every expert and rollout worker a GPU of its own, or set "
                             f"cluster.sync=object_store.")


class BroadcastGroup:
    """This process's place in one generation of the run's broadcast group."""

    def __init__(self, spec: GroupSpec, rank: int):
        if spec.backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("cluster.collective_backend=nccl needs a GPU in every expert and rollout "
                               "worker; use gloo (CPU weights) or cluster.sync=object_store")
        backend = backend_for(spec.device)
        join_group(spec.host, spec.port, f"generation-{spec.generation}", rank, world_size=spec.world_size,
                   backend=backend, timeout_s=spec.timeout_s)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        # every rank takes part in creating every subgroup, in the same order
        self.groups = {e: dist.new_group(ranks, backend=backend, timeout=timeout)
                       for e, ranks in spec.subgroups.items()}
        self.sources = {e: ranks[0] for e, ranks in spec.subgroups.items()}
        self.rank, self.generation, self.device = rank, spec.generation, spec.device

    def send(self, expert_id: str, tensors: dict[str, torch.Tensor]) -> None:
        dist.broadcast(flatten(tensors, self.device), src=self.rank, group=self.groups[expert_id])

    def receive(self, expert_id: str, plan: list[tuple]) -> dict[str, torch.Tensor]:
        """Fresh tensors of `plan`'s layout, on the group's device, filled by `expert_id`'s broadcast."""
        buffer = torch.empty(buffer_bytes(plan), dtype=torch.uint8, device=self.device)
        dist.broadcast(buffer, src=self.sources[expert_id], group=self.groups[expert_id])
        return unflatten(buffer, plan)


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

    def broadcast_device(self) -> tuple | None:
        """(this process's node, the GPU ids Ray gave it), or None if it was given none."""
        ids = ray.get_gpu_ids() if ray.is_initialized() else []
        return (this_node(), tuple(sorted(str(i) for i in ids))) if ids else None
