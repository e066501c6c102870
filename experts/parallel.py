"""One expert on several processes (`experts.<id>.parallel`): its ranks' shares of a step's samples,
their gradients combined, FSDP2 sharding, and the expert's whole state gathered from the shards.

Convention: rank r of M computes the loss of its contiguous share of the step's samples,
normalised by the count of the whole batch (valid tokens for a refiner, trained transitions for
the generator), so the ranks' losses add up to the one-process loss and their gradients, summed
across ranks, are its gradient (to float rounding); stats add up the same way. `ddp` keeps the
whole model on every rank and sums gradients with one all-reduce after the backward passes;
`fsdp` shards parameters, gradients and optimizer state with FSDP2's `fully_shard` (per block,
then the rest), whose reduce-scatter is set to sum. Weights leave an expert whole (gathered one
tensor at a time); under fsdp each rank's optimizer state leaves as its own shard (`OptimizerShard`),
restored on the same rank of a gang of the same size, and written to checkpoints by every rank with
torch.distributed.checkpoint (experts/state_file.py), from which any number of ranks restores.
"""
from __future__ import annotations

import datetime
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from experts.records import OptimizerShard
from experts.weights import optimizer_arrays, optimizer_tensors

FORWARD_METHODS = ("token_logprobs",)  # model methods other than forward that the losses call


@dataclass(frozen=True)
class GangSpec:
    """Everything a rank needs to join generation `generation` of its expert's process group."""
    host: str
    port: int
    generation: int
    ranks: int
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class Gang:
    """This process's place in its expert's process group."""
    rank: int
    ranks: int
    strategy: str
    generation: int

    def rows(self, n: int) -> torch.Tensor:
        """The indices of this rank's share of `n` samples (contiguous; shares differ by at most one)."""
        return torch.tensor_split(torch.arange(n), self.ranks)[self.rank]

    def largest_share(self, n: int) -> int:
        """The size of the largest rank's share of `n` samples (the first ranks': `rows`)."""
        return -(-n // self.ranks)

    @property
    def leader(self) -> bool:
        return self.rank == 0


def join(spec: GangSpec, rank: int) -> None:
    """Make this process rank `rank` of the spec's process group, leaving any older one first."""
    join_group(spec.host, spec.port, f"gang-{spec.generation}", rank, world_size=spec.ranks, backend=spec.backend,
               timeout_s=spec.timeout_s)


def join_group(host: str, port: int, prefix: str, rank: int, *, world_size: int, backend: str,
               timeout_s: float) -> None:
    """This process as rank `rank` of the default process group whose rendezvous is the TCPStore at
    host:port, under `prefix` (one per generation of a group); an older group is left first."""
    if dist.is_initialized():
        dist.destroy_process_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def backend_for(device: torch.device) -> str:
    """The backend of a process group whose ranks keep their tensors on `device`: gloo between CPU
    processes; between GPUs NCCL for device tensors and gloo for any host tensor a collective is
    given (NCCL takes device tensors only: object collectives, a checkpoint's coordination)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


# What torch.distributed raises when a peer of a process group is gone (its process died, its node
# or the network failed) or a collective timed out waiting for it. gloo: RuntimeErrors from its
# transport ("[…/gloo/transport/tcp/pair.cc:553] Connection closed by peer …", "[…/gloo/transport/
# tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete", both seen
# here with torch 2.13). NCCL: DistBackendErrors whose text pytorch writes in
# torch/csrc/distributed/c10d/NCCLUtils.cpp (`getNcclErrorDetailStr`: "ncclRemoteError: A call
# failed possibly due to a network error or a remote process exiting prematurely.", "ncclSystemError:
# System call (e.g. socket, malloc) or external library call failed or device error."; NCCL's own
# string for ncclRemoteError, "remote process exited or there was a network error";
# `NCCLComm::getNcclComm`: "NCCL communicator was aborted on rank …", after its watchdog, in
# ProcessGroupNCCL.cpp, "Watchdog caught collective operation timeout: WorkNCCL(…)").
PEER_LOST = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "ncclRemoteError",
             "remote process exited", "ncclSystemError", "NCCL communicator was aborted",
             "Watchdog caught collective operation timeout")
# NCCL's word for a call that can never work (NCCLUtils.cpp: "ncclInvalidUsage: This usually reflects
# invalid usage of NCCL library.", "ncclInvalidArgument: Invalid value for an argument."), such as
# two ranks on one GPU (NCCL's init logs "Duplicate GPU detected : rank 1 and rank 0 both on CUDA
# device …" and returns ncclInvalidUsage): a mistake to report, not a peer to wait for.
MISUSED = ("ncclInvalidUsage", "ncclInvalidArgument")


def peer_lost(error: BaseException) -> bool:
    """Whether `error` says a peer of the process group is gone: torch.distributed's own error type
    (a DistBackendError, DistNetworkError or DistStoreError), or a plain RuntimeError in the words of
    PEER_LOST (gloo's; NCCL's, where an older torch raised them plainly), unless NCCL called the
    call itself invalid. A tensor on a device the backend does not take is a mistake, not a loss."""
    if nccl_misused(error):
        return False
    return isinstance(error, dist.DistError) or any(w in str(error) for w in PEER_LOST)


def nccl_misused(error: BaseException) -> bool:
    """Whether NCCL refused `error`'s call as invalid usage (see MISUSED)."""
    return any(w in str(error) for w in MISUSED)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the members of every ModuleList of modules with parameters,
    outermost lists only (a transformer's layers). FSDP shards each on its own and activation
    checkpointing recomputes each."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList) and any(True for m in module for _ in m.parameters()):
            found += [m for m in module if any(True for _ in m.parameters())]
            inside |= {id(sub) for m in module for sub in m.modules()}
    return found


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass instead of keeping them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    units = {id(b) for b in blocks(model)}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in units)


def shard(model: nn.Module, device: torch.device, reshard_after_forward: bool = True,
          mixed_precision=None) -> nn.Module:
    """`model` sharded in place over the process group with FSDP2: each block, then the rest; its
    gradients summed, not averaged, across ranks (the convention above). `mixed_precision`: an
    FSDP2 MixedPrecisionPolicy (experts/precision.py), None: computed as kept."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in [*blocks(model), model]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mixed_precision or MixedPrecisionPolicy())
        unit.set_gradient_divide_factor(1.0)  # each unit reduces its own gradients
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    for name in FORWARD_METHODS:
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    return model


@contextmanager
def gathered_through_update(model: nn.Module, reference: nn.Module,
                            reshard_after_forward: bool) -> Iterator[Callable[[], None]]:
    """fsdp with `defer_gradient_sync`: within it the sharded `model` (and a sharded `reference`)
    stay gathered after their first all-gather and the gradients accumulate whole; it yields what
    to call before the last backward pass, which reduce-scatters them once and reshards. After
    it, every unit behaves as `shard` set it."""
    from torch.distributed.fsdp import FSDPModule
    sharded = [m for m in (model, reference) if isinstance(m, FSDPModule)]
    for m in sharded:
        m.set_reshard_after_forward(False)
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)

    def reduce_at_last_pass() -> None:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
    try:
        yield reduce_at_last_pass
    finally:
        reduce_at_last_pass()
        for m in sharded:
            for unit in blocks(m):
                unit.set_reshard_after_forward(reshard_after_forward, recurse=False)
            m.set_reshard_after_forward(False, recurse=False)  # FSDP's own choice for the root
            m.reshard()


@contextmanager
def gathered_for_rollout(model: nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """fsdp under `cluster.layout=colocated`: within it every unit of the sharded `model` is whole
    (gathered once on entering, a collective every rank makes in the same order) and stays whole
    through any number of forward passes, which then need no collective: the ranks sample shares
    that differ in their passes (a counterfactual drawn here and not there) without waiting on each
    other. Sharded again after, each unit as `shard` set it."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # FSDP2 makes whichever unit runs forward first the root of its own tree: a sampler that calls a
    # block directly (a refiner's token loop) must find the model's root set up first
    model._get_fsdp_state()._lazy_init()
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in blocks(model):
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)
        for unit in units:
            unit.reshard()


def sum_gradients(params: list[nn.Parameter]) -> None:
    """`ddp`: every rank's gradients replaced by their sum over ranks, in one all-reduce."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def whole_norm(norm: torch.Tensor) -> float:
    """The norm `clip_grad_norm_` returned, as the whole gradient's: under fsdp a DTensor over the
    sharded gradients (torch 2.13 returns it replicated, already reduced; one still partial is
    reduced here, every rank calling); under ddp every rank holds the summed gradient already."""
    return float(norm.full_tensor() if is_dtensor(norm) else norm)


def stats_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device's collectives carry it (gloo on the host; NCCL on CUDA, whose
    ncclFloat64 pytorch maps from at::kDouble), float32 on any other device (MPS has no float64,
    not every accelerator's collective library carries it): the stats are sums of a few values."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def sum_stats(loss: float, stats: dict, device: torch.device) -> tuple[float, dict]:
    """The step's loss and stats from every rank's share of them: all-reduces on `device`, the
    model's (NCCL reduces only device tensors), in `stats_dtype`: sums, but of the stats named
    `*_max`, whose maximum is taken."""
    keys, highest = sorted(k for k in stats if not k.endswith("_max")), sorted(k for k in stats if k.endswith("_max"))
    values = torch.tensor([loss, *[float(stats[k]) for k in keys]], dtype=stats_dtype(device), device=device)
    dist.all_reduce(values)
    out = dict(zip(keys, values[1:].tolist()))
    if highest:
        peaks = torch.tensor([float(stats[k]) for k in highest], dtype=stats_dtype(device), device=device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        out.update(zip(highest, peaks.tolist()))
    return float(values[0]), out


def gathered(model: nn.Module, state: dict[str, torch.Tensor], *, by_unit: bool = True,
             keep: bool = True) -> dict[str, torch.Tensor] | None:
    """`state` (entries of the sharded `model`'s state_dict) whole on the CPU, gathered one FSDP
    unit at a time (one all-gather each; a collective: every rank calls it), so a device never
    holds more than one unit whole; plain entries as they are. Not `by_unit` (units gathered in
    another dtype than they keep, under mixed precision): one tensor at a time, as kept. A rank
    that does not `keep` them (not the leader) takes part in the gathering and copies nothing to
    the host: None."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    from torch.distributed.fsdp import FSDPModule
    out = {k: v for k, v in state.items() if not is_dtensor(v)}  # plain entries, as they are
    for prefix, unit in model.named_modules():
        if not by_unit or not isinstance(unit, FSDPModule):
            continue
        unit.unshard()  # its own parameters become whole plain tensors until `reshard`
        for name, p in unit.named_parameters(prefix=prefix):
            key = name.replace(_CHECKPOINT_PREFIX, "")
            if key in state and key not in out and not is_dtensor(p):
                out[key] = p.detach().to("cpu", copy=True) if keep else None
        unit.reshard()
    for k, v in state.items():  # the rest one tensor at a time: each an all-gather on every rank
        if k not in out:
            whole = v.full_tensor()
            out[k] = whole.cpu() if keep else None
    return {k: out[k] for k in state} if keep else None


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor. None is until something imported torch.distributed.tensor (FSDP2
    does, to shard a model), so a process that shards nothing never pays for its import (~1 s)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def sharded_like(whole: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`whole` tensors cut like the DTensors of `own` of the same name (each rank keeps its own
    shard, no communication); names whose `own` tensor is plain stay whole."""
    from torch.distributed.tensor import distribute_tensor
    out = {}
    for k, v in whole.items():
        mine = own.get(k)
        out[k] = (distribute_tensor(v.to(mine.device), mine.device_mesh, mine.placements, src_data_rank=None)
                  if is_dtensor(mine) else v)
    return out


def optimizer_shard(optimizer: torch.optim.Optimizer, gang: Gang) -> OptimizerShard:
    """This rank's part of the optimizer state: its shards of the moments as host arrays
    (`optimizer_arrays`), wherever the shards live."""
    state = optimizer.state_dict()
    local = {pid: {k: v.to_local() if is_dtensor(v) else v for k, v in entries.items()}
             for pid, entries in state["state"].items()}
    return OptimizerShard(gang.rank, gang.ranks, optimizer_arrays({**state, "state": local}))


def from_shard(shard: OptimizerShard, params: list[nn.Parameter]) -> dict:
    """An `optimizer_shard`'s state as the sharded `params`' optimizer holds it (same rank, same gang size)."""
    from torch.distributed.tensor import DTensor

    def like(v, p):
        if is_dtensor(p) and isinstance(v, torch.Tensor) and v.dim() == p.dim() and v.dim() > 0:
            return DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        return v
    state = optimizer_tensors(shard.state)
    return {**state, "state": {pid: {k: like(v, params[int(pid)]) for k, v in entries.items()}
                               for pid, entries in state["state"].items()}}


def sharded_optimizer_state(state: dict, params: list[nn.Parameter]) -> dict:
    """A whole optimizer state_dict (a checkpoint's, or a one-rank expert's) cut like the sharded `params` it
    belongs to (their order is the optimizer's)."""
    return {**state, "state": {pid: {k: (sharded_like({k: v}, {k: params[int(pid)]})[k]
                                         if isinstance(v, torch.Tensor) and v.shape == params[int(pid)].shape else v)
                                     for k, v in entries.items()}
                               for pid, entries in state["state"].items()}}


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this process holds (local shards only)."""
    def size(t) -> int:
        t = t.to_local() if is_dtensor(t) else t
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    params = list(model.parameters())
    return {"params": sum(size(p) for p in params),
            "grads": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(v) for entries in optimizer.state.values() for v in entries.values())}
