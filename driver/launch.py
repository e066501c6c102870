"""Starting, following and stopping the driver: in-process for `inline`, else as the named Ray
actor `<run_name>/driver`.

The driver actor is pinned to the node of the process that starts it, so the run directory it
writes is the one the user named. The run's placement groups are reserved here, before anything
starts, so a cluster that cannot hold the run says so to the caller.
"""
from __future__ import annotations

from pathlib import Path

from cluster.connect import check_private_ray
from cluster.expert_actor import ExpertActor
from cluster.placement import Placement
from cluster.runtime import InlineHandle, Runtime, get
from driver.config import dump_config
from driver.driver_actor import DriverActor


def save_config(config, run_dir: Path) -> Path:
    """RUN_DIR/config.yaml, the resolved config the run trains with (written whole or not at all)."""
    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("config.yaml.tmp")
    tmp.write_text(dump_config(config))
    tmp.replace(path)
    return path


def start_driver(config, run_dir: Path, resume: Path | None = None, expert_cls=ExpertActor):
    """A handle to a new driver (its experts, workers and weight sync started and synced), resumed
    from the checkpoint folder `resume` if given; its experts are `expert_cls` actors. Once it is
    up, the resolved config is saved in the run directory (a failed resume changes nothing)."""
    resume = str(Path(resume).resolve()) if resume else None
    if config.cluster.mode == "inline":
        import torch
        torch.set_num_threads(1)
        driver = InlineHandle(DriverActor(config, str(run_dir), resume, None, expert_cls))
    else:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        placement = Placement(config, config.trainer.run_name, planned_gpus(config))  # raises PlacementError
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        driver = Runtime("ray", config.trainer.run_name).spawn(
            DriverActor, config, str(Path(run_dir).resolve()), resume, placement, expert_cls, name="driver",
            max_concurrency=2, scheduling_strategy=here)
        try:
            get(driver.poll.remote(0))  # raises what its start-up raised (cluster/startup.py)
        except Exception:  # its actors died with it; the bundles reserved for them are given back
            ray.kill(driver)
            placement.release()
            raise
    save_config(config, run_dir)
    return driver


def planned_gpus(config) -> list[list[tuple[str, float]]] | None:
    """The memory plan's GPUs (per GPU: its actors and their shares) on a Ray cluster with GPUs,
    for a run that asks for GPUs; None otherwise (driver/plan.py)."""
    import ray

    from driver.plan import cluster_target, plan_for
    from driver.preflight import gpu_asks
    if ray.cluster_resources().get("GPU", 0) <= 0 or not any(r.num_gpus > 0 for r in gpu_asks(config)):
        return None
    return plan_for(config, cluster_target(config)).gpu_groups()


def follow(driver, done, on_row=None, seen: int = 0, *, until=None, interval_s: float = 0.1) -> int:
    """Hand each new metrics row of the running `driver` to `on_row`, until its run (the ObjectRef
    `done`) has ended or `until(rows seen)` holds; returns the rows seen. Raises RayGone once the
    private Ray under the run has lost a process (its calls would wait for it for a minute)."""
    import ray
    while True:
        check_private_ray()
        finished = bool(ray.wait([done], timeout=interval_s)[0])
        for row in get(driver.poll.remote(seen)):
            if on_row:
                on_row(row)
            seen += 1
        if finished or (until and until(seen)):
            return seen


def stop_driver(driver) -> None:
    """End a finished (or failed) run: its actors stop and its placement groups are given back."""
    if isinstance(driver, InlineHandle):
        return
    import ray
    try:
        get(driver.shutdown.remote())
    finally:
        ray.kill(driver)
