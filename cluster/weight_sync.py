"""`WeightSyncActor`: the registry of published versions and their delivery to rollout workers.

A new version is put in the object store once (by the expert, as its snapshot); a publish hands
each worker its ObjectRef (fetched zero-copy on the worker's node, pulled through the object store
from other nodes) with the weights' fingerprint, and returns only once every worker has checked
the fingerprint and acknowledged that version. Only experts whose version changed are published.
With `cluster.sync=collective` the experts broadcast their new versions into the workers instead
(cluster/collective.py), and the object store is the fallback.
"""
from __future__ import annotations

import datetime
import time
import warnings
import zlib

import numpy as np
import ray
import torch
import torch.distributed as dist

from cluster.collective import GroupSpec
from cluster.runtime import get


class CorruptWeights(RuntimeError):
    """Weights whose fingerprint does not match the one they were published with."""


def as_tensor(value) -> torch.Tensor:
    """A numpy array (read-only ones from the object store too) or a tensor, as a tensor, uncopied."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    with warnings.catch_warnings():  # read-only views are only read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(value))


def fingerprint(weights: dict) -> int:
    """A fast fingerprint of a weights dict (numpy arrays or tensors, on any device): every array's
    name, shape and dtype, and the sum of its bytes as 64-bit words (mod 2^64), mixed in name
    order. It catches truncated, missing or corrupted tensors at memory speed (about 5 ms per
    100 MB); it is not a cryptographic hash."""
    total = 0
    for name in sorted(weights):
        tensor = as_tensor(weights[name]).contiguous()
        if tensor.data_ptr() % 8:  # a view at an odd offset of a flat buffer: read as words from a copy
            tensor = tensor.clone()
        raw = tensor.reshape(-1).view(torch.uint8)
        whole = raw.numel() // 8 * 8
        words = int(raw[:whole].view(torch.int64).sum()) % (1 << 64) + int(raw[whole:].sum())
        dtype = str(tensor.dtype).removeprefix("torch.")
        label = zlib.crc32(f"{name}{tuple(tensor.shape)}{dtype}".encode())
        total = (total * 1_000_003 + label + words) % (1 << 64)
    return total


class WeightSyncActor:
    """The registry of published versions; delivers each to every worker and collects the acks."""

    def __init__(self, workers: list, experts: dict | None = None, collective: dict | None = None):
        """`experts` (id -> handle) and `collective` ({"backend", "timeout_s"}) are given when the
        run syncs by broadcast (`cluster.sync=collective`); else versions go through the object store."""
        self.workers, self.experts, self.collective = workers, experts, collective
        self.registry: dict[str, int] = {}
        self.store, self.generation, self.intact = None, 0, False

    def publish(self, releases: list[tuple[str, int, int, list]], broadcast: bool = False) -> dict:
        """`releases`: (expert_id, version, fingerprint, [weights ref]) each; the ref is boxed so it
        passes through to the workers unresolved. `broadcast`: these are the experts' current
        versions, which a collective run sends by broadcast; if that fails the object store
        delivers them instead (and the group is formed anew before the next broadcast)."""
        start = time.perf_counter()
        acks, fallback, via = None, None, "object_store"
        if broadcast and self.collective:
            try:
                acks, via = self.broadcast(releases), "collective"
            except Exception as error:  # any broken member: the object store still holds every version
                self.intact, fallback = False, f"{type(error).__name__}: {error}"
        if acks is None:
            acks = get([w.load_weights.remote(eid, version, box[0], checksum)
                        for eid, version, checksum, box in releases for w in self.workers])
        expected = [(eid, version) for eid, version, _, _ in releases for _ in self.workers]
        for (eid, version), ack in zip(expected, acks):
            if ack != version:
                raise RuntimeError(f"a rollout worker acknowledged {eid} v{ack}, expected v{version}")
        for eid, version, _, _ in releases:
            self.registry[eid] = version
        return {"registry": dict(self.registry), "acks": len(acks), "sync_s": time.perf_counter() - start,
                "via": via, "fallback": fallback}

    def broadcast(self, releases: list[tuple]) -> list[int]:
        """Each expert broadcasts its current weights into every worker; returns the workers' acks."""
        self.form_group()
        senders, acks = [], []
        for eid, version, checksum, _ in releases:
            senders.append(self.experts[eid].send_weights.remote(version))
            acks += [w.receive_weights.remote(eid, version, checksum) for w in self.workers]
        return get(acks + senders)[:len(acks)]

    def form_group(self) -> None:
        """Experts (ranks 0..N) and workers (N+1..) in one process group, with a subgroup per expert;
        formed anew when a member restarted (it is in no generation) or a broadcast failed."""
        members = [*self.experts.values(), *self.workers]
        generations = get([m.broadcast_generation.remote() for m in members])  # raises if one is down
        if self.intact and all(g == self.generation for g in generations):
            return
        timeout = self.collective["timeout_s"]
        if self.store is None:
            host = ray.util.get_node_ip_address()
            self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=timeout))
        self.generation += 1
        n = len(self.experts)
        workers = list(range(n, n + len(self.workers)))
        spec = GroupSpec(self.store.host, self.store.port, self.generation, len(members),
                         {e: [rank, *workers] for rank, e in enumerate(self.experts)},
                         self.collective["backend"], timeout)
        get([m.join_broadcast.remote(spec, rank) for rank, m in enumerate(members)])
        self.intact = True

    def registrations(self) -> dict[str, int]:
        return dict(self.registry)
