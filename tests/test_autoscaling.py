"""Autoscaling on Ray's fake multi-node provider: a head with no CPU, a worker type of 2 CPUs
(0 to 3 nodes), and the `shapes-cluster` preset, whose placement groups ask for 6 CPUs. The
autoscaler sees the demand and adds workers; the run completes on them.

The 2.60 wheel lacks the provider's base config (`fake_multi_node/example.yaml`), so the whole
config is written here. `AutoscalingCluster` would run `ray stop --force`, killing every Ray on
the machine (the tests' own too), so the head is started like any user's, in a process group of
its own that the test stops."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.test_job_submit import free_port, start_head, stop_head

pytestmark = pytest.mark.cluster  # its tests start the command in a process of its own, or a Ray cluster

WORKER_CPUS, MAX_WORKERS = 2, 3
SMALL = ["trainer.steps=2", "trainer.prompts_per_step=2", "algorithm.group_size=4", "algorithm.num_skip_refinement=1",
         "experts.generator.sample_steps=4"]


def fake_provider_config(gcs_address: str) -> dict:
    return {
        "cluster_name": "jointrl-fake", "max_workers": MAX_WORKERS, "upscaling_speed": 1.0, "idle_timeout_minutes": 5,
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "cpu_worker": {"resources": {"CPU": WORKER_CPUS}, "node_config": {}, "min_workers": 0,
                           "max_workers": MAX_WORKERS}},
        "head_node_type": "ray.head.default",
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": []}


def alive_nodes(address: str, env: dict) -> list[dict]:
    """The cluster's live nodes, read by a client of its own (this process talks to the tests' Ray)."""
    probe = ("import json, ray; ray.init(address=%r)\n"
             "print('NODES', json.dumps([n for n in ray.nodes() if n['Alive']]))")
    out = subprocess.run([sys.executable, "-c", probe % address], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("NODES "))[6:])


@pytest.fixture
def autoscaling_head(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = tmp_path / "autoscaling.json"
    config.write_text(json.dumps(fake_provider_config(address)))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_AUTH_MODE": "token"}
    log = tmp_path / "head.log"
    proc = start_head([f"--port={port}", f"--autoscaling-config={config}", "--num-cpus=0",
                       "--include-dashboard=false"], env, log)
    deadline = time.monotonic() + 60
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    yield address, env, log
    stop_head(proc)


def test_a_run_needing_more_cpus_than_the_head_has_gets_workers_added(autoscaling_head, tmp_path):
    address, env, log = autoscaling_head
    assert [n["Resources"].get("CPU", 0) for n in alive_nodes(address, env)] == [0]   # the head alone, no CPU
    run_dir = tmp_path / "run"
    sets = [a for s in [*SMALL, f"cluster.address={address}", "cluster.placement_timeout_s=240"] for a in ("--set", s)]
    train = subprocess.run([sys.executable, "-m", "driver", "train", "--config", "shapes-cluster", *sets,
                            "--run-dir", str(run_dir)], env=env, capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:] + log.read_text()[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and rows[-1]["version/generator"] == 2
    workers = [n for n in alive_nodes(address, env) if n["Resources"].get("CPU", 0) > 0]
    assert len(workers) == 3 and all(n["Resources"]["CPU"] == WORKER_CPUS for n in workers)  # 6 CPUs for 6 bundles
