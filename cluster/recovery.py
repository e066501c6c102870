"""Surviving actor faults: a call whose actor died is made again once Ray has restarted the actor
and `recover` has brought the new instance back to where the old one was.

Ray restarts the actors (`cluster.max_restarts`) but not their state: an expert restarts at
version 0 and a rollout worker without weights. `recover` restores that state from what the driver
holds (the expert's latest snapshot, the published weights), so the retried call computes exactly
what the lost one would have. Inline mode has no actor faults and passes straight through.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import ray
from ray.exceptions import ObjectLostError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

LOG = logging.getLogger("jointrl.recovery")


@dataclass
class FaultCounts:
    """Actor faults survived so far, counted where they were noticed (the expert group and the
    rollout pool share one): a worker that dies during a weight sync counts as a sync fault."""
    expert_restarts: int = 0
    worker_restarts: int = 0
    sync_restarts: int = 0
    sync_fallbacks: int = 0
    rollouts_lost: int = 0
    replayed_updates: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class NotSynced(RuntimeError):
    """A rollout worker asked to serve before it holds every expert's weights (it restarted)."""


class RolloutLost(RuntimeError):
    """A step's rollout outputs were lost with the node that held them; the rollout is made again."""


class SnapshotLost(RuntimeError):
    """An expert's new snapshot was lost with its node before the driver kept a copy of it."""


def this_node() -> str | None:
    """The Ray node of the calling process (None without Ray)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def in_ray_actor() -> bool:
    """True inside a Ray actor, where return values are copied into the object store on return."""
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def here() -> NodeAffinitySchedulingStrategy:
    """Scheduling on the calling process's node (where the driver keeps what it must not lose)."""
    return NodeAffinitySchedulingStrategy(this_node(), soft=False)


def relay(*values) -> tuple:
    """Its arguments, returned as they are, and True: run on a node, it leaves a copy of each in that
    node's object store, owned by the caller; the last value says the copies are made."""
    return (*values, True)


def keep_here(refs: tuple, made_on: str | None) -> tuple:
    """`refs` with their data on this node. An object lives in the store of the node that made it
    and is lost with it; the driver keeps what it restores experts from (their snapshots) on its
    own node, which a run cannot outlive anyway. The copies are made by a task on this node (`relay`):
    the driver never deserializes what it keeps. Objects made here are kept as they are."""
    if made_on == this_node():
        return refs
    *kept, made = ray.remote(relay).options(num_cpus=0, num_returns=len(refs) + 1, scheduling_strategy=here(),
                                            max_retries=0).remote(*refs)
    try:
        ray.get(made)
    except ObjectLostError as lost:
        settle(kept)
        raise SnapshotLost(f"a snapshot made on node {made_on} was lost with it") from lost
    return tuple(kept)


def settle(refs) -> None:
    """Take the errors of a failed call's other outputs, so Ray does not report them as unhandled."""
    try:
        ray.get(list(refs))
    except (RayActorError, NotSynced, ray.exceptions.RayTaskError):
        pass


def failed_to_start(error: BaseException) -> bool:
    """Whether `error` says an actor died raising in its constructor: Ray does not restart such an
    actor, so there is nothing to wait for."""
    return isinstance(error, RayActorError) and error.actor_init_failed


class Retry:
    """The run's one way through an actor fault: a call whose actor died (or whose result shows one
    of the faults the caller names) is made again once Ray has restarted the actor and `recover`
    has brought the new instance back to where the old one was, up to `cluster.max_restarts` times,
    each restart waited out for up to `cluster.restart_wait_s` seconds. An actor that failed in its
    constructor is not waited for: Ray does not restart it. Each fault survived is logged under the
    call's name and counted in the `FaultCounts` field the caller names."""

    def __init__(self, cluster, faults: FaultCounts | None = None):
        """`cluster`: the config's cluster section; `faults`: where survived faults are counted
        (None: nowhere, for callers whose restarts no metric reports)."""
        self.max_restarts, self.restart_wait_s, self.faults = cluster.max_restarts, cluster.restart_wait_s, faults

    def __call__(self, call, *, recover, name: str, counter: str | None, again=None, retried: tuple = ()):
        """`call()`'s value. After a fault, `recover()` (raising RayActorError while Ray still
        restarts the actor), then `again()` (default: `call`), which makes the lost call anew.
        `retried`: the exception types besides RayActorError that mean the call must be made again;
        `counter`: the FaultCounts field each fault bumps."""
        attempt, faults = call, 0
        while True:
            try:
                return attempt()
            except (RayActorError, *retried) as error:
                if faults == self.max_restarts or failed_to_start(error):
                    raise
                faults += 1
                LOG.warning("%s: %s (fault %d of at most %d); waiting for its actor and making the call again",
                            name, type(error).__name__, faults, self.max_restarts)
                if self.faults is not None and counter is not None:
                    setattr(self.faults, counter, getattr(self.faults, counter) + 1)
                self.recovered(recover)
                attempt = again or call

    def recovered(self, recover) -> None:
        """`recover()`, tried again every 0.1 s while Ray restarts the actor, for up to
        `restart_wait_s` seconds."""
        deadline = time.monotonic() + self.restart_wait_s
        while True:
            try:
                return recover()
            except RayActorError as still:  # still restarting
                if time.monotonic() > deadline or failed_to_start(still):
                    raise
                time.sleep(0.1)
