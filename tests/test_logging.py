"""Logging and looking: a Ray run with a pool of reward actors scoring a torch-scorer plug-in,
TensorBoard, W&B (offline) and sample sheets on; `jointrl report` draws its curves and samples."""
import json

import pytest

import driver.cli as cli
from tests.conftest import assert_same_training, looks_like_a_picture, make_config, run_training

STEPS = 3
SCORED = ["reward.terms.sharpness={fn: tasks.scorers:sharpness, weight: 0.2}"]


def config(*extra):
    return make_config(f"trainer.steps={STEPS}", "cluster.rollout_workers=2", *SCORED, *extra, preset="shapes-tiny")


@pytest.fixture(scope="module")
def logged_run(ray_session, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("logged")
    cfg = config("reward.terms.sharpness.actors=2", "logging.tensorboard=true", "logging.wandb=true", "logging.images_every=2",
                 "logging.images_per_log=6")
    rows, _, _ = run_training(cfg, run_dir)
    return run_dir, rows


def test_a_reward_actor_pool_scores_as_the_workers_would(logged_run, tmp_path):
    _, rows = logged_run
    inline, _, _ = run_training(config("cluster.mode=inline", "cluster.rollout_workers=1"), tmp_path)
    assert_same_training(rows, inline)
    assert all(0.0 < r["reward/sharpness"] < 1.0 for r in rows)


def test_tensorboard_events_hold_every_metric_and_the_samples(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir, rows = logged_run
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0}).Reload()
    tags = events.Tags()
    for key in ("reward/total", "reward/sharpness", "loss/generator", "version/refiner_1", "time/step_s"):
        assert key in tags["scalars"], key
        assert [e.step for e in events.Scalars(key)] == [r["step"] for r in rows]
        assert events.Scalars(key)[-1].value == pytest.approx(rows[-1][key], rel=1e-5)
    assert [e.step for e in events.Images("samples")] == [0, 2]  # every 2 steps, and the last


def test_wandb_logs_offline_without_a_network(logged_run):
    run_dir, _ = logged_run
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))


def test_sample_sheets_and_the_report_are_pictures(logged_run, capsys):
    run_dir, rows = logged_run
    for step in (0, 2):
        looks_like_a_picture(run_dir / "samples" / f"step_{step:06d}.png")
        meta = json.loads((run_dir / "samples" / f"step_{step:06d}.json").read_text())
        assert len(meta["prompts"]) == 6 and set(meta["refinements"][0]) == {"refiner_0", "refiner_1", "refiner_2"}
    assert cli.main(["report", str(run_dir)]) == 0
    names = {"rewards", "experts", "versions", "timing", "staleness", "losses", "samples"}
    written = {p.stem for p in (run_dir / "report").glob("*.png")}
    assert written == names, written
    for name in names:
        looks_like_a_picture(run_dir / "report" / f"{name}.png")
    assert "samples.png" in capsys.readouterr().out


def test_report_of_a_run_without_logged_samples_draws_them(tmp_path, capsys):
    run_dir = tmp_path / "plain"
    assert cli.main(["train", "--config", "shapes-tiny", "--run-dir", str(run_dir), "--set", "cluster.mode=inline",
                     "--set", "trainer.steps=2"]) == 0
    assert cli.main(["report", str(run_dir)]) == 0
    looks_like_a_picture(run_dir / "report" / "samples.png")
    assert cli.main(["report", str(tmp_path / "nothing")]) == 2
    assert "no metrics" in capsys.readouterr().err


def test_a_reward_pool_scores_with_the_tasks_own_reward_when_no_plugin_is_named(tmp_path):
    base = ["trainer.steps=2", "cluster.mode=inline"]
    pooled, _, _ = run_training(make_config(*base, "reward.actors=1", preset="shapes-tiny"), tmp_path / "pooled")
    local, _, _ = run_training(make_config(*base, preset="shapes-tiny"), tmp_path / "local")
    assert_same_training(pooled, local)
