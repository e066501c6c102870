"""Losing a node costs time, never correctness: on three simulated nodes (`ray.cluster_utils.Cluster`),
the node that hosts an expert, and later the one that hosts a rollout worker, are removed mid-run.
Ray restarts their actors on the nodes left, the driver restores them from the snapshots it keeps
on its own node, lost rollout outputs are made again, and the run ends with metrics identical to an
uninterrupted one. The cluster gets its own Ray, so the scenario runs in a subprocess of its own. One
refiner: each further one is one more actor to start and restore, and changes nothing here."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster  # its tests start the command in a process of its own, or a Ray cluster

STEPS = 6
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                      "health_check_failure_threshold": 3, "health_check_timeout_ms": 500}


def config(mode: str, name: str):
    from driver.preflight import load_config
    pool = "resources.custom={pool: 0.01}"
    return load_config("shapes-tiny", [f"trainer.steps={STEPS}", "cluster.rollout_workers=2", f"cluster.mode={mode}",
                                       f"trainer.run_name={name}", f"cluster.rollout_{pool}", "experts.n_refiners=1",
                                       *[f"experts.{e}.{pool}" for e in ("refiner_0", "generator")]])


def scenario(out: Path) -> dict:
    """Runs in its own process: the reference inline, then the ray run with two nodes removed."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster.runtime import get
    from driver.launch import follow, start_driver

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": FAST_HEALTH_CHECKS})
    pool_nodes = [cluster.add_node(num_cpus=1, resources={"pool": 10}) for _ in range(2)]
    ray.init(address=cluster.address, namespace="jointrl")
    try:
        get(start_driver(config("inline", "node-loss-reference"), out / "reference").run.remote())
        driver = start_driver(config("ray", "node-loss"), out / "ray")
        done = driver.run.remote()
        removed, seen = [], 0
        for after, victim in ((2, "expert/refiner_0"), (4, "rollout/1")):
            seen = follow(driver, done, seen=seen, until=lambda n, after=after: n >= after, interval_s=0.05)
            if seen < after:
                get(done)
                raise AssertionError("the run finished before the node was removed")
            node_id = get(ray.get_actor(f"node-loss/{victim}").node.remote())
            node = next(n for n in pool_nodes if n.node_id == node_id)
            cluster.remove_node(node, allow_graceful=False)
            pool_nodes.remove(node)
            pool_nodes.append(cluster.add_node(num_cpus=1, resources={"pool": 10}))  # as an autoscaler would
            removed.append({"victim": victim, "node": node_id, "at_rows": after, "time": time.time()})
        get(done)
        info = get(driver.inspect.remote())
    finally:
        ray.shutdown()
        cluster.shutdown()
    rows = {m: [json.loads(line) for line in (out / m / "metrics.jsonl").read_text().splitlines()]
            for m in ("reference", "ray")}
    return {"removed": removed, "rows": rows, "info": info}


def test_removing_the_nodes_of_an_expert_and_a_worker_changes_nothing(tmp_path):
    from tests.conftest import assert_same_training  # here: this file also runs as a script
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert [r["victim"] for r in result["removed"]] == ["expert/refiner_0", "rollout/1"]
    rows, reference = result["rows"]["ray"], result["rows"]["reference"]
    assert [r["step"] for r in rows] == list(range(STEPS))                  # the run completes, nothing lost
    last = rows[-1]
    assert last["faults/expert_restarts"] >= 1 and last["faults/worker_restarts"] + last["faults/sync_restarts"] >= 1
    for e in ("refiner_0", "generator"):
        assert [r[f"version/{e}"] for r in rows] == list(range(1, STEPS + 1))  # exactly once, monotonic
    assert result["info"]["registry"] == {e: STEPS for e in result["info"]["snapshots"]}
    assert_same_training(rows, reference)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    (out / "result.json").write_text(json.dumps(scenario(out), default=str))
