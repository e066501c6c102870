"""Surviving actor faults: a call whose actor died is made again once Ray has restarted the actor
and `recover` has brought the new instance back to where the old one was.

Ray restarts the actors (`cluster.max_restarts`) but not their state: an expert restarts at
version 0 and a rollout worker without weights. `recover` restores that state from what the driver
holds (the expert's latest snapshot, the published weights), so the retried call computes exactly
what the lost one would have. Inline mode has no actor faults and passes straight through.
"""
from __future__ import annotations

import time

from ray.exceptions import RayActorError


class NotSynced(RuntimeError):
    """A rollout worker asked to serve before it holds every expert's weights (it restarted)."""


def survive(attempt, recover, attempts: int, lost: tuple = (), wait_s: float = 120.0):
    """`attempt(first)` fetches (and, when not `first`, first resubmits) a call's result. If its
    actor died, or the result shows one of `lost`, `recover()` (waiting out Ray's restart) and
    attempt again, up to `attempts` times. Returns (value, faults survived)."""
    faults = 0
    while True:
        try:
            return attempt(faults == 0), faults
        except (RayActorError, *lost):
            if faults == attempts:
                raise
            faults += 1
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    recover()
                    break
                except RayActorError:  # still restarting
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
