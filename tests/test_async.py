"""Asynchronous rollouts (`cluster.max_staleness=k`): step t+k's rollout is made while step t
updates, every sample's lag behind each expert is measured and bounded, and the run stays exact:
inline equals ray, a resumed run equals the uninterrupted one, a killed worker changes nothing."""
import json
import shutil

import numpy as np
import pytest

import driver.cli as cli
from driver import checkpoint
from algorithm.staleness import lags, within
from tests.conftest import assert_same_training, make_config, run_killing, run_training

STEPS = 6


def config(*extra, mode="ray", workers=2, staleness=1):
    return make_config(f"trainer.steps={STEPS}", f"cluster.max_staleness={staleness}", f"cluster.mode={mode}",
                       f"cluster.rollout_workers={workers}", *extra, preset="shapes-tiny")


def read_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lag_is_measured_per_expert_and_samples_beyond_the_bound_are_dropped():
    versions = {"refiner_0": 5, "generator": 3}
    vectors = [{"refiner_0": 5, "generator": 3}, {"refiner_0": 4, "generator": 3}, {"refiner_0": 5, "generator": 1}]
    lag = lags(vectors, versions)
    assert lag["refiner_0"].tolist() == [0, 1, 0] and lag["generator"].tolist() == [0, 0, 2]
    assert within(lag, 0).tolist() == [True, False, False]
    assert within(lag, 1).tolist() == [True, True, False]
    assert within(lag, 2).all()
    with pytest.raises(RuntimeError, match="never published.*generator"):
        lags([{"refiner_0": 5, "generator": 4}], versions)


@pytest.fixture(scope="module")
def async_ray_run(ray_session, tmp_path_factory):
    rows, info, _ = run_training(config(), tmp_path_factory.mktemp("async_ray"))
    return rows, info


def test_async_inline_equals_ray_and_every_sample_lags_one_version(async_ray_run, tmp_path):
    rows, info = async_ray_run
    inline, _, _ = run_training(config(mode="inline", workers=1), tmp_path / "inline")
    assert_same_training(inline, rows)
    for r in rows:
        lag = 0 if r["step"] == 0 else 1  # step 0's rollout was made before any update
        assert all(r[f"staleness/{e}"] == lag for e in ("refiner_0", "refiner_1", "refiner_2", "generator"))
        assert r["staleness/dropped_samples"] == 0
        assert r["version/generator"] == r["step"] + 1
        assert r["time/rollout_s"] > 0 and r["time/update_s"] > 0 and r["time/idle_s"] >= 0
    assert info["in_flight"] == []  # nothing was made beyond the last step
    sync, _, _ = run_training(config(mode="inline", workers=1, staleness=0), tmp_path / "sync")
    assert sync[0]["reward/total"] == rows[0]["reward/total"]  # the same first rollout
    assert all(r["staleness/generator"] == 0 for r in sync)
    assert any(abs(a["reward/total"] - b["reward/total"]) > 1e-6 for a, b in zip(sync[1:], rows[1:]))


def test_staleness_two_keeps_two_rollouts_in_flight(tmp_path):
    rows, _, _ = run_training(config(mode="inline", workers=1, staleness=2), tmp_path)
    assert [r["staleness/generator"] for r in rows] == [0, 1, 2, 2, 2, 2]
    assert [r["staleness/refiner_0"] for r in rows] == [0, 1, 2, 2, 2, 2]


def test_resume_with_a_rollout_in_flight_equals_the_uninterrupted_run(async_ray_run, tmp_path):
    reference, _ = async_ray_run
    full = tmp_path / "full"
    assert cli.main(["train", "--config", "shapes-tiny", "--run-dir", str(full), "--set", "cluster.mode=inline",
                     "--set", f"trainer.steps={STEPS}", "--set", "cluster.max_staleness=1",
                     "--set", "trainer.checkpoint_every=2", "--set", "trainer.keep_checkpoints=3"]) == 0
    assert_same_training(read_rows(full), reference)
    # step 2's rollout was in flight at checkpoint 2, made with every expert's version 1
    manifest = checkpoint.manifest(full / "checkpoints" / "step_000002")
    assert manifest["in_flight"] == {"2": {"refiner_0": 1, "refiner_1": 1, "refiner_2": 1, "generator": 1}}
    assert manifest["versions"]["generator"] == 2
    assert checkpoint.manifest(full / "checkpoints" / "step_000006")["in_flight"] == {}
    stopped = tmp_path / "stopped"
    shutil.copytree(full, stopped)
    for later in ("step_000004", "step_000006"):
        shutil.rmtree(stopped / "checkpoints" / later)
    assert cli.main(["train", "--resume", str(stopped), "--set", "cluster.mode=ray"]) == 0
    assert_same_training(read_rows(stopped), reference)


def test_a_worker_killed_during_an_async_run_changes_nothing(async_ray_run, tmp_path):
    reference, _ = async_ray_run
    rows, _ = run_killing(config(), tmp_path, [(1, "rollout/1"), (3, "rollout/1")])
    assert rows[-1]["faults/worker_restarts"] + rows[-1]["faults/sync_restarts"] >= 2
    assert_same_training(rows, reference)  # redone with the weights it was first made with
    assert np.all(np.diff([r["version/generator"] for r in rows]) == 1)
