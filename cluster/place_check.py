"""`jointrl plan --place`: the run's placement reserved on Ray from its plan and read back, without
a GPU in sight.

The run's own placement groups (cluster/placement.py, one bundle per planned GPU) are reserved;
one placeholder actor per planned actor is scheduled with the options the run's actor would get
(its bundle, its share of the GPU, num_cpus=0) and asks Ray which GPU ids it was given
(`ray.get_gpu_ids()`) and which of the GPU actors' environment variables it holds
(cluster/runtime.py `GPU_ENV`: the placeholders are spawned as the run's actors are). Ray needs no
GPU for this: a Ray that declares GPUs (`ray start --head --num-gpus 8`, or the private local Ray
started here declaring the target's) assigns ids all the same. Everything is released before
returning, whatever happened.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import os

import ray

from cluster.connect import connect, end_private_ray
from cluster.placement import Placement
from cluster.runtime import GPU_ENV, Runtime


class Placeholder:
    """Stands where a planned actor would run, and says which GPUs Ray gave it and the GPU actors'
    environment variables it was given."""

    def gpu_ids(self) -> list:
        return [int(i) if str(i).isdigit() else i for i in ray.get_gpu_ids()]

    def gpu_env(self) -> dict[str, str | None]:
        return {k: os.environ.get(k) for k in GPU_ENV}


def placed_ids(config, gpu_groups: list[list[tuple[str, float]]], gpus: int,
               verbose: bool = False) -> tuple[dict[str, list], dict[str, dict]]:
    """({actor: the GPU ids Ray gave it}, {actor: its GPU_ENV variables}) for the plan's `gpu_groups`
    (per GPU: (actor, share)), on `config`'s cluster (cluster.address, RAY_ADDRESS) or a local Ray
    declaring `gpus` GPUs."""
    started = not ray.is_initialized()
    log = None if verbose else Path(tempfile.mkdtemp(prefix="jointrl-place-")) / "ray.log"
    connect(config.cluster.address, num_cpus=1, log_file=log, num_gpus=gpus)
    placement, actors = None, {}
    try:
        run = f"{config.trainer.run_name or 'plan'}-place"
        placement, runtime = Placement(config, run, gpu_groups), Runtime("ray", run)
        for gpu in gpu_groups:
            for name, _ in gpu:
                actors[name] = runtime.spawn(Placeholder, name=name, **placement.options[name])
        return (dict(zip(actors, ray.get([a.gpu_ids.remote() for a in actors.values()]))),
                dict(zip(actors, ray.get([a.gpu_env.remote() for a in actors.values()]))))
    finally:
        for a in actors.values():
            ray.kill(a)
        if placement is not None:
            placement.release()
        if started:
            end_private_ray()
