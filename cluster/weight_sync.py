"""`WeightSyncActor`: the registry of published versions and their delivery to rollout workers.

A new version is put in the object store once (by the expert, as its snapshot); a publish hands
each worker its ObjectRef (fetched zero-copy on the worker's node, pulled through the object store
from other nodes) with the weights' fingerprint, and returns only once every worker has checked
the fingerprint and acknowledged that version. Only experts whose version changed are published.
"""
from __future__ import annotations

import time
import zlib

import numpy as np

from cluster.runtime import get


class CorruptWeights(RuntimeError):
    """Weights whose fingerprint does not match the one they were published with."""


def fingerprint(weights: dict[str, np.ndarray]) -> int:
    """A fast fingerprint of a weights dict: every array's name, shape and dtype, and the sum of its
    bytes as 64-bit words (mod 2^64), mixed in name order. It catches truncated, missing or
    corrupted tensors at memory speed (about 5 ms per 100 MB); it is not a cryptographic hash."""
    total = 0
    for name in sorted(weights):
        array = np.ascontiguousarray(weights[name])
        raw = array.reshape(-1).view(np.uint8)
        whole = raw.size // 8 * 8
        words = int(raw[:whole].view(np.uint64).sum(dtype=np.uint64)) + int(raw[whole:].sum())
        label = zlib.crc32(f"{name}{array.shape}{array.dtype}".encode())
        total = (total * 1_000_003 + label + words) % (1 << 64)
    return total


class WeightSyncActor:
    def __init__(self, workers: list):
        self.workers = workers
        self.registry: dict[str, int] = {}

    def publish(self, releases: list[tuple[str, int, int, list]]) -> dict:
        """`releases`: (expert_id, version, fingerprint, [weights ref]) each; the ref is boxed so it
        passes through to the workers unresolved."""
        start = time.perf_counter()
        calls = [(eid, version, w.load_weights.remote(eid, version, box[0], checksum))
                 for eid, version, checksum, box in releases for w in self.workers]
        acks = get([c[2] for c in calls])
        for (eid, version, _), ack in zip(calls, acks):
            if ack != version:
                raise RuntimeError(f"a rollout worker acknowledged {eid} v{ack}, expected v{version}")
        for eid, version, _, _ in releases:
            self.registry[eid] = version
        return {"registry": dict(self.registry), "acks": len(acks), "sync_s": time.perf_counter() - start}

    def registrations(self) -> dict[str, int]:
        return dict(self.registry)
