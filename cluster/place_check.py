"""`jointrl plan --place`: a plan's placement reserved on Ray and read back, without a GPU in sight.

One placement bundle per planned GPU ({"GPU": 1}); one placeholder actor per planned actor, in its
GPU's bundle with its share of it (num_cpus=0), asks Ray which GPU ids it was given
(`ray.get_gpu_ids()`). Ray needs no GPU for this: a Ray that declares GPUs (`ray start --head
--num-gpus 8`, or the private local Ray started here declaring the target's) assigns ids all the
same. Everything is released before returning, whatever happened.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.connect import connect
from cluster.placement import PlacementError


class Placeholder:
    """Stands where a planned actor would run, and says which GPUs Ray gave it."""

    def gpu_ids(self) -> list:
        return [int(i) if str(i).isdigit() else i for i in ray.get_gpu_ids()]


def placed_ids(groups: list[list[tuple[str, float]]], address: str | None, gpus: int, timeout_s: float,
               verbose: bool = False) -> dict[str, list]:
    """{actor: the GPU ids Ray gave it} for the plan's `groups` (per GPU: (actor, share))."""
    started = not ray.is_initialized()
    log = None if verbose else Path(tempfile.mkdtemp(prefix="jointrl-place-")) / "ray.log"
    connect(address, num_cpus=1, log_file=log, num_gpus=gpus)
    pg, actors = None, {}
    try:
        if not groups:
            return {}
        pg = placement_group([{"GPU": 1.0} for _ in groups], strategy="PACK", name="jointrl-plan-place")
        if not ray.wait([pg.ready()], timeout=timeout_s)[0]:
            raise PlacementError(f"the plan's {len(groups)} GPU bundles were not reserved within "
                                 f"cluster.placement_timeout_s={timeout_s:g} s; the cluster has "
                                 f"{ray.cluster_resources().get('GPU', 0):g} GPUs")
        for index, group in enumerate(groups):
            for name, share in group:
                actors[name] = ray.remote(Placeholder).options(
                    num_cpus=0, num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=index)).remote()
        return dict(zip(actors, ray.get([a.gpu_ids.remote() for a in actors.values()])))
    finally:
        for a in actors.values():
            ray.kill(a)
        if pg is not None:
            remove_placement_group(pg)
        if started:
            ray.shutdown()
