"""The records an expert's state travels in: where it stands, a snapshot of it, a released version."""
from __future__ import annotations

from typing import Any, NamedTuple


class ExpertInfo(NamedTuple):
    """Where an expert stands: its version (0 at start, +1 per applied update), the last step it
    applied, and the fingerprint of that version's weights (None where not computed)."""
    version: int
    last_step: int
    checksum: int | None = None


class Snapshot(NamedTuple):
    """Everything that restores an expert exactly: its weights as they travel ({name: array}), its
    optimizer state_dict (None: fresh moments) and its ExpertInfo. An expert returns one as three
    objects, so the driver holds it as three ObjectRefs of this shape and fetches only the small info."""
    weights: Any
    optimizer: Any
    info: Any


class Release(NamedTuple):
    """A published version of an expert: what rollout workers are given, and check, to serve it.
    `weights` is the weights dict, or an ObjectRef (or an in-process stand-in) to one."""
    version: int
    weights: Any
    fingerprint: int


class OptimizerShard(NamedTuple):
    """One rank's part of a sharded (fsdp) expert's optimizer state: its shards of the moments."""
    rank: int
    ranks: int
    state: dict


class ShardedOptimizer(NamedTuple):
    """A sharded expert's optimizer state in a snapshot: each rank's OptimizerShard (or a ref to it),
    in rank order."""
    shards: list


class ShardFiles(NamedTuple):
    """A sharded expert's optimizer state as every rank wrote it with torch.distributed.checkpoint
    ({file name: the sha256 of a file written into the checkpoint already, or its bytes}), with the
    optimizer's hyper-parameters (its param_groups)."""
    files: dict
    param_groups: list
