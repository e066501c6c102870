"""Killed actors cost time, never correctness: an expert, a rollout worker or the weight-sync actor
killed mid-run is restarted by Ray and restored by the driver; the run finishes with every update
applied exactly once, versions only rising, and metrics identical to a fault-free run. The run keeps
its experts' optimizer state every second update only (cluster.optimizer_snapshot_every=2), so
each killed expert is restored from an older snapshot and replays the update since. One refiner:
every kind of actor is there, and each further refiner is one more process to start and kill."""
from tests.conftest import assert_same_training, make_config, run_killing, run_training

STEPS = 8
KILLS = [(1, "expert/refiner_0"), (2, "rollout/1"), (3, "expert/generator"), (4, "weight_sync"),
         (5, "expert/refiner_0"), (6, "rollout/1")]  # (after that many steps, kill this actor)


def config(*extra):
    return make_config(f"trainer.steps={STEPS}", "cluster.rollout_workers=2", "experts.n_refiners=1", *extra,
                       preset="shapes-tiny")


def test_every_kind_of_killed_actor_is_restored_and_the_run_is_unchanged(ray_session, tmp_path):
    rows, info = run_killing(config("cluster.optimizer_snapshot_every=2"), tmp_path / "killed", KILLS)
    assert [r["step"] for r in rows] == list(range(STEPS))                  # nothing lost
    last = rows[-1]
    assert last["faults/expert_restarts"] == 3             # only updates call experts: each kill noticed there
    assert last["faults/replayed_updates"] > 0             # restored from a snapshot one update old
    assert last["faults/worker_restarts"] + last["faults/sync_restarts"] == 3  # a dead worker may be noticed
    for e in ("refiner_0", "generator"):                                    # by a publish instead
        versions = [r[f"version/{e}"] for r in rows]
        assert versions == list(range(1, STEPS + 1)), (e, versions)        # exactly once, monotonic
        assert info["snapshots"][e] == {"version": STEPS, "last_step": STEPS - 1}
    assert info["registry"] == {e: STEPS for e in info["snapshots"]}       # the sync registry is rebuilt
    reference, _, _ = run_training(config("cluster.mode=inline", "cluster.rollout_workers=1"), tmp_path / "reference")
    assert_same_training(rows, reference)
