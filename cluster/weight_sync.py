"""`WeightSyncActor`: the registry of published versions and their delivery to rollout workers.

A new version is put in the object store once (by the expert, as its snapshot); a publish hands
each worker its ObjectRef (fetched zero-copy on the worker's node, pulled through the object store
from other nodes) with the weights' fingerprint, and returns only once every worker has checked
the fingerprint and acknowledged that version. Only experts whose version changed are published.
With `cluster.sync=collective` the experts broadcast their new versions into the workers instead
(cluster/collective.py), and the object store is the fallback: a broadcast that fails (a member
restarted, a timeout) is delivered through it and the group formed anew for the next one, which
the log says once. A group that can never work (NCCL members sharing a GPU) is refused instead,
once, naming `cluster.sync`.
"""
from __future__ import annotations

import datetime
import logging
import time
from typing import NamedTuple

import ray
import torch.distributed as dist

from cluster.collective import CollectiveRefused, GroupSpec, refuse_shared_gpus, refused
from cluster.runtime import Members, get
from cluster.startup import reports_start
from experts.parallel import nccl_misused
from experts.records import Release

LOG = logging.getLogger("jointrl.sync")


class SyncResult(NamedTuple):
    """How a publish went: its seconds, the path it took (collective, object_store; none: there are
    no rollout workers to deliver to, cluster.layout=colocated) and, if a
    broadcast failed and the object store delivered instead, why."""
    sync_s: float
    via: str
    fallback: str | None


class WeightSyncActor:
    """The registry of published versions; delivers each to every worker and collects the acks."""

    @reports_start
    def __init__(self, members: Members, workers: list[str], experts: list[str] | None = None,
                 collective: dict | None = None):
        """`workers`: the rollout workers' names. `experts` (ids) and `collective` ({"backend",
        "timeout_s"}) are given when the run syncs by broadcast (`cluster.sync=collective`); else
        versions go through the object store."""
        self.workers = [members(name) for name in workers]
        self.names = [*(f"expert/{e}" for e in experts or []), *workers]  # the group's members, in rank order
        self.experts = {e: members(f"expert/{e}") for e in experts} if experts is not None else None
        self.collective = collective
        self.registry: dict[str, int] = {}
        self.store, self.generation, self.intact = None, 0, False
        self.fallbacks = 0

    def publish(self, releases: dict[str, Release], broadcast: bool = False) -> SyncResult:
        """Deliver every expert's release to every worker and collect their acknowledgements. A
        release's weights ref sits inside the dict, so it passes through to the workers unresolved.
        `broadcast`: these are the experts' current versions, which a collective run sends by
        broadcast; if that fails the object store delivers them instead (and the group is formed
        anew before the next broadcast)."""
        start = time.perf_counter()
        if not self.workers:  # cluster.layout=colocated: the experts roll out with the weights they hold
            self.registry.update({eid: release.version for eid, release in releases.items()})
            return SyncResult(time.perf_counter() - start, "none", None)
        acks, fallback, via = None, None, "object_store"
        if broadcast and self.collective:
            try:
                acks, via = self.broadcast(releases), "collective"
            except CollectiveRefused:
                raise
            except Exception as error:  # any broken member: the object store still holds every version
                if nccl_misused(error):
                    raise refused(error) from error
                self.intact, fallback = False, f"{type(error).__name__}: {error}"
                self.say_fallback(fallback)
        if acks is None:
            acks = get([w.load_weights.remote(eid, *release) for eid, release in releases.items() for w in self.workers])
        expected = [(eid, release.version) for eid, release in releases.items() for _ in self.workers]
        for (eid, version), ack in zip(expected, acks):
            if ack != version:
                raise RuntimeError(f"a rollout worker acknowledged {eid} v{ack}, expected v{version}")
        self.registry.update({eid: release.version for eid, release in releases.items()})
        return SyncResult(time.perf_counter() - start, via, fallback)

    def say_fallback(self, why: str) -> None:
        """The first fallback in the log, with its reason; the later ones are counted only
        (`faults/sync_fallbacks`)."""
        if not self.fallbacks:
            LOG.warning("cluster.sync=collective: a broadcast failed (%s); the object store delivered this sync, as "
                        "it will every sync whose broadcast fails (counted in faults/sync_fallbacks), and the group "
                        "is formed again for the next one", why)
        self.fallbacks += 1

    def broadcast(self, releases: dict[str, Release]) -> list[int]:
        """Each expert broadcasts its current weights into every worker; returns the workers' acks."""
        self.form_group()
        senders, acks = [], []
        for eid, release in releases.items():
            senders.append(self.experts[eid].send_weights.remote(release.version))
            acks += [w.receive_weights.remote(eid, release.version, release.fingerprint) for w in self.workers]
        return get(acks + senders)[:len(acks)]

    def form_group(self) -> None:
        """Experts (ranks 0..N) and workers (N+1..) in one process group, with a subgroup per expert;
        formed anew when a member restarted (it is in no generation) or a broadcast failed."""
        members = [*self.experts.values(), *self.workers]
        generations = get([m.broadcast_generation.remote() for m in members])  # raises if one is down
        if self.intact and all(g == self.generation for g in generations):
            return
        refuse_shared_gpus(self.collective["backend"],
                           dict(zip(self.names, get([m.broadcast_device.remote() for m in members]))))
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
