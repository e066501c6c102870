"""Asynchronous rollouts (`cluster.max_staleness=k`): step t+k's rollout is made while step t
updates, every sample's lag behind each expert is measured and bounded, and the run stays exact:
inline equals ray, a resumed run equals the uninterrupted one, a killed worker changes nothing."""
import json
import shutil
import time

import numpy as np
import pytest
import ray

import driver.cli as cli
from algorithm.batch import step_samples
from algorithm.staleness import lags, within
from cluster.expert_actor import ExpertActor
from cluster.rollout_worker import RolloutWorker
from cluster.runtime import Runtime, get
from driver import checkpoint
from driver.launch import start_driver, stop_driver
from experts import state_file
from experts.weights import fingerprint
from tasks import build_task
from tests.conftest import assert_same_training, make_config, run_killing, run_training
from tests.driver_watch import watch_driver, watched

STEPS = 6
# One refiner beside the generator: lags are per expert whatever their number, and each further
# refiner is one more actor process to start.
EXPERTS = ("refiner_0", "generator")


def config(*extra, mode="ray", workers=2, staleness=1):
    return make_config(f"trainer.steps={STEPS}", f"cluster.max_staleness={staleness}", f"cluster.mode={mode}",
                       f"cluster.rollout_workers={workers}", "experts.n_refiners=1", *extra, preset="shapes-tiny")


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
    """The asynchronous run on Ray, checkpointed every 2 steps (each checkpoint but the last keeps
    the older weights of a rollout in flight), its driver watched from step 0 on (`watch_driver`)."""
    cfg = config("trainer.checkpoint_every=2")
    cfg.trainer.run_name = "async-ray"
    run_dir = tmp_path_factory.mktemp("async_ray")
    driver = start_driver(cfg, run_dir)
    get(driver.__ray_call__.remote(watch_driver))
    get(driver.run.remote())
    info = get(driver.inspect.remote())
    seen = get(driver.__ray_call__.remote(watched))
    final = {e: get(get(driver.expert_weights.remote(e))) for e in ("generator", "refiner_0")}
    stop_driver(driver)
    return read_rows(run_dir), info, seen, run_dir, final


def test_the_driver_forwards_snapshots_and_never_deserializes_a_tensor(async_ray_run):
    """Checkpoints and in-flight weights are written by a task on the driver's node from the
    references the driver holds: the driver fetched none of its snapshots' weights or optimizer
    states, and rebuilt no tensor at all, yet every checkpoint is whole."""
    rows, _, watched, run_dir, final = async_ray_run
    assert len(watched["snapshots"]) == 2 * len(EXPERTS) * STEPS  # a weights and an optimizer ref per expert per update
    assert not watched["fetched"] & watched["snapshots"]
    assert watched["tensors"] == 0
    manifest = checkpoint.manifest(run_dir / "checkpoints" / "step_000002")  # verified against its hashes
    assert manifest["in_flight"] == {"2": {e: 1 for e in EXPERTS}}
    last = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    assert checkpoint.verify(last, list(EXPERTS)) == STEPS
    snapshot = state_file.read(last, "generator")
    assert snapshot.optimizer["state"] and snapshot.info.version == STEPS
    for e, weights in final.items():
        saved = state_file.read_weights(last / f"{e}.safetensors")
        assert all(np.array_equal(saved[k].numpy(), v) for k, v in weights.items()), e


def test_async_inline_equals_ray_and_every_sample_lags_one_version(async_ray_run, tmp_path):
    rows, info, *_ = async_ray_run
    inline, _, _ = run_training(config(mode="inline", workers=1), tmp_path / "inline")
    assert_same_training(inline, rows)
    for r in rows:
        lag = 0 if r["step"] == 0 else 1  # step 0's rollout was made before any update
        assert all(r[f"staleness/{e}"] == lag for e in EXPERTS)
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
    reference, *_ = async_ray_run
    full = tmp_path / "full"
    assert cli.main(["train", "--config", "shapes-tiny", "--run-dir", str(full), "--set", "cluster.mode=inline",
                     "--set", "experts.n_refiners=1", "--set", f"trainer.steps={STEPS}", "--set", "cluster.max_staleness=1",
                     "--set", "trainer.checkpoint_every=2", "--set", "trainer.keep_checkpoints=3"]) == 0
    assert_same_training(read_rows(full), reference)
    # step 2's rollout was in flight at checkpoint 2, made with every expert's version 1
    manifest = checkpoint.manifest(full / "checkpoints" / "step_000002")
    assert manifest["in_flight"] == {"2": {e: 1 for e in EXPERTS}}
    assert manifest["versions"]["generator"] == 2
    assert checkpoint.manifest(full / "checkpoints" / "step_000006")["in_flight"] == {}
    stopped = tmp_path / "stopped"
    shutil.copytree(full, stopped)
    for later in ("step_000004", "step_000006"):
        shutil.rmtree(stopped / "checkpoints" / later)
    assert cli.main(["train", "--resume", str(stopped), "--set", "cluster.mode=ray"]) == 0
    assert_same_training(read_rows(stopped), reference)


def test_a_worker_killed_during_an_async_run_changes_nothing(async_ray_run, tmp_path):
    reference, *_ = async_ray_run
    rows, _ = run_killing(config(), tmp_path, [(1, "rollout/1"), (3, "rollout/1")])
    assert rows[-1]["faults/worker_restarts"] + rows[-1]["faults/sync_restarts"] >= 2
    assert_same_training(rows, reference)  # redone with the weights it was first made with
    assert np.all(np.diff([r["version/generator"] for r in rows]) == 1)


def test_a_delivery_returns_while_a_rollout_runs_and_changes_none_of_its_weights(ray_session, tmp_path):
    """Weights reach a worker in a concurrency group of their own: a delivery (what a broadcast of
    `cluster.sync=collective` waits on) returns while a rollout is in its reward phase, and that
    rollout is still made by the versions it named; the delivered version is served after it."""
    started = tmp_path / "reward-started"
    cfg = config("trainer.prompts_per_step=1",
                 f"reward.terms.image={{fn: tests.faulty_rewards:Slow, started: '{started}', seconds: 3}}")
    worker = Runtime("ray", "delivery-test").spawn(RolloutWorker, cfg, 0, name="rollout/0")
    try:
        experts = {e: ExpertActor(cfg, e) for e in cfg.experts.ids()}
        first = {e: expert.weights() for e, expert in experts.items()}
        get([worker.load_weights.remote(e, 0, w, fingerprint(w)) for e, w in first.items()])
        samples = step_samples(build_task(cfg).train_prompts(), step=0, seed=cfg.trainer.seed,
                               prompts_per_step=cfg.trainer.prompts_per_step, group_size=cfg.algorithm.group_size,
                               num_skip_refinement=cfg.algorithm.num_skip_refinement)
        meta, *_ = worker.rollout.options(num_returns=2 + len(cfg.experts.active_refiners())).remote(
            0, samples, {e: 0 for e in first})
        deadline = time.monotonic() + 120
        while not started.exists():
            assert time.monotonic() < deadline and not ray.wait([meta], timeout=0.05)[0], "the reward never started"
        newer = {k: v + 1.0 if v.dtype.kind == "f" else v for k, v in first["generator"].items()}
        assert get(worker.load_weights.remote("generator", 1, newer, fingerprint(newer))) == 1
        assert not ray.wait([meta], timeout=0)[0]                   # the rollout is still running
        assert all(v["generator"] == 0 for v in get(meta).versions)  # made by the version it named
        assert get(worker.version_vector.remote())["generator"] == 1  # the delivered one, from then on
    finally:
        ray.kill(worker)
