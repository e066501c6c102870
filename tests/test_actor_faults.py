"""Killed actors cost time, never correctness: an expert, a rollout worker or the weight-sync actor
killed mid-run is restarted by Ray and restored by the driver; the run finishes with every update
applied exactly once, versions only rising, and metrics identical to a fault-free run."""
import pytest

from tests.conftest import assert_same_training, make_config, run_killing, run_training

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
    killed = 2
    rows, info = run_killing(config(f"faults-{kind}"), tmp_path, TARGETS[kind], after=(2, 5))
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
