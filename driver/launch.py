"""Starting the driver: in-process for `inline`, else as the named Ray actor `<run_name>/driver`.

The driver actor is pinned to the node of the process that starts it, so the run directory it
writes is the one the user named.
"""
from __future__ import annotations

from pathlib import Path

from cluster.runtime import InlineHandle, Runtime
from driver.driver_actor import DriverActor


def start_driver(config, run_dir: Path, resume: Path | None = None):
    """A handle to a new driver (its experts, workers and weight sync started and synced), resumed
    from the checkpoint folder `resume` if given."""
    resume = str(Path(resume).resolve()) if resume else None
    if config.cluster.mode == "inline":
        import torch
        torch.set_num_threads(1)
        return InlineHandle(DriverActor(config, str(run_dir), resume))
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return Runtime("ray", config.trainer.run_name).spawn(
        DriverActor, config, str(Path(run_dir).resolve()), resume, name="driver", max_concurrency=2,
        scheduling_strategy=here)
