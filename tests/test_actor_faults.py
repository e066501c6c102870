"""Killed actors cost time, never correctness: an expert, a rollout worker or the weight-sync actor
killed mid-run is restarted by Ray and restored by the driver; the run finishes with every update
applied exactly once, versions only rising, and metrics identical to a fault-free run."""
import json
import time

import pytest
import ray

from cluster.runtime import get
from driver.launch import start_driver, stop_driver
from tests.conftest import assert_same_training, make_config, run_training

STEPS = 8
TARGETS = {"expert": "expert/refiner_1", "generator": "expert/generator", "worker": "rollout/1",
           "sync": "weight_sync"}


def config(name):
    cfg = make_config(f"trainer.steps={STEPS}", "cluster.rollout_workers=2", preset="shapes-tiny")
    cfg.trainer.run_name = name
    return cfg


@pytest.fixture(scope="module")
def reference(ray_session, tmp_path_factory):
    rows, _, _ = run_training(config("faults-reference"), tmp_path_factory.mktemp("reference"))
    return rows


@pytest.mark.parametrize("kind", list(TARGETS))
def test_killed_actor_is_restored_and_the_run_is_unchanged(kind, reference, tmp_path):
    name = f"faults-{kind}"
    driver = start_driver(config(name), tmp_path)
    done = driver.run.remote()
    killed = 0
    for after in (2, 5):  # kill twice, at whatever moment of a step the poll lands in
        while len(get(driver.poll.remote(0))) < after:
            if ray.wait([done], timeout=0.05)[0]:
                get(done)  # raises the run's error, if it failed
                pytest.fail("the run finished before the kill")
        ray.kill(ray.get_actor(f"{name}/{TARGETS[kind]}", namespace="jointrl"), no_restart=False)
        killed += 1
        time.sleep(0.3)
    get(done)
    info = get(driver.inspect.remote())
    stop_driver(driver)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))                  # nothing lost
    noticed = sum(rows[-1][f"faults/{c}"] for c in ("expert_restarts", "worker_restarts", "sync_restarts"))
    assert noticed == killed                                               # every kill noticed and survived
    if kind in ("expert", "generator"):  # only updates call experts; a dead worker may be noticed by a publish
        assert rows[-1]["faults/expert_restarts"] == killed
    for e in ("refiner_0", "refiner_1", "refiner_2", "generator"):
        versions = [r[f"version/{e}"] for r in rows]
        assert versions == list(range(1, STEPS + 1)), (e, versions)        # exactly once, monotonic
        assert info["snapshots"][e] == {"version": STEPS, "last_step": STEPS - 1}
    assert info["registry"] == {e: STEPS for e in info["snapshots"]}       # the sync registry is rebuilt
    assert_same_training(rows, reference)
