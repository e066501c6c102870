"""`jointrl plan --place`: the run's placement reserved on Ray from its plan and read back, without
a GPU in sight.

The run's own placement groups (cluster/placement.py, one bundle per planned GPU) are reserved;
one placeholder actor per planned actor is scheduled with the options the run's actor would get
(its bundle, its share of the GPU, num_cpus=0) and asks Ray which GPU ids it was given
(`ray.get_gpu_ids()`). Ray needs no GPU for this: a Ray that declares GPUs (`ray start --head
--num-gpus 8`, or the private local Ray started here declaring the target's) assigns ids all the
same. Everything is released before returning, whatever happened.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import ray

from cluster.connect import connect, end_private_ray
from cluster.placement import Placement


class Placeholder:
    """Stands where a planned actor would run, and says which GPUs Ray gave it."""

    def gpu_ids(self) -> list:
        return [int(i) if str(i).isdigit() else i for i in ray.get_gpu_ids()]


def placed_ids(config, gpu_groups: list[list[tuple[str, float]]], gpus: int, verbose: bool = False) -> dict[str, list]:
    """{actor: the GPU ids Ray gave it} for the plan's `gpu_groups` (per GPU: (actor, share)), on
    `config`'s cluster (cluster.address, RAY_ADDRESS) or a local Ray declaring `gpus` GPUs."""
    started = not ray.is_initialized()
    log = None if verbose else Path(tempfile.mkdtemp(prefix="jointrl-place-")) / "ray.log"
    connect(config.cluster.address, num_cpus=1, log_file=log, num_gpus=gpus)
    placement, actors = None, {}
    try:
        placement = Placement(config, f"{config.trainer.run_name or 'plan'}-place", gpu_groups)
        for gpu in gpu_groups:
            for name, _ in gpu:
                actors[name] = ray.remote(Placeholder).options(num_cpus=0, **placement.options[name]).remote()
        return dict(zip(actors, ray.get([a.gpu_ids.remote() for a in actors.values()])))
    finally:
        for a in actors.values():
            ray.kill(a)
        if placement is not None:
            placement.release()
        if started:
            end_private_ray()
