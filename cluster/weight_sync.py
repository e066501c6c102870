"""`WeightSyncActor`: the registry of published versions and their delivery to rollout workers.

A publish hands each worker the ObjectRef of an expert's weights (fetched zero-copy from the object
store on the worker's node) and returns only once every worker has acknowledged that version.
"""
from __future__ import annotations

import time

from cluster.runtime import get


class WeightSyncActor:
    def __init__(self, workers: list):
        self.workers = workers
        self.registry: dict[str, int] = {}

    def publish(self, releases: list[tuple[str, int, list]]) -> dict:
        """`releases`: (expert_id, version, [weights ref]) each; the ref is boxed so it passes through."""
        start = time.perf_counter()
        calls = [(eid, version, w.load_weights.remote(eid, version, box[0]))
                 for eid, version, box in releases for w in self.workers]
        acks = get([c[2] for c in calls])
        for (eid, version, _), ack in zip(calls, acks):
            if ack != version:
                raise RuntimeError(f"a rollout worker acknowledged {eid} v{ack}, expected v{version}")
        for eid, version, _ in releases:
            self.registry[eid] = version
        return {"registry": dict(self.registry), "acks": len(acks), "sync_s": time.perf_counter() - start}

    def registrations(self) -> dict[str, int]:
        return dict(self.registry)
