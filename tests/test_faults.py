"""A reward that raises, hangs or returns NaN/inf: its samples are dropped and counted, the run
finishes, versions only rise and no NaN reaches the weights; a reward that fails on every sample
step after step stops the run (checkpointed, exit 3), saying which term and why."""
import json

import numpy as np
import pytest

import driver.cli as cli
from driver.checkpoint import checkpoint_exists, checkpoint_path
from tests.conftest import make_config, run_training


def faulty_run(tmp_path, fn, *extra):
    cfg = make_config(f"reward.terms.image.fn=tests.faulty_rewards:{fn}", "cluster.mode=inline", "trainer.steps=4",
                      "trainer.prompts_per_step=6", *extra, preset="shapes-tiny")
    rows, info, weights = run_training(cfg, tmp_path, inspect_weights=tuple(cfg.experts.ids()))
    assert len(rows) == 4 and [r["step"] for r in rows] == [0, 1, 2, 3]
    for e in cfg.experts.ids():
        versions = [r[f"version/{e}"] for r in rows]
        assert versions == sorted(versions)                                   # monotonic
        assert all(np.isfinite(v).all() for v in weights[e].values()), e      # no NaN reached the weights
    return rows


@pytest.mark.parametrize("fn, kind", [("nan_on_counting", "reward_nan"), ("raises_on_position", "reward_error"),
                                      ("hangs_on_two_objects", "reward_timeout")])
def test_faulty_samples_are_dropped_counted_and_the_rest_train(fn, kind, tmp_path):
    rows = faulty_run(tmp_path, fn, "reward.timeout_s=0.3", "reward.timeout_per_image_s=0.005")
    faults = sum(r[f"faults/{kind}"] for r in rows)
    dropped = sum(r["faults/dropped_samples"] for r in rows)
    assert faults > 0 and dropped >= faults - sum(r.get("counterfactual/generations", 0) for r in rows)
    assert all(r["faults/skipped_update"] == 0 for r in rows)
    assert rows[-1]["version/generator"] == 4                                # the valid samples still trained
    assert all(r["reward/total"] is not None and np.isfinite(r["reward/total"]) for r in rows)


def test_a_step_without_valid_samples_skips_every_update(tmp_path):
    rows = faulty_run(tmp_path, "always_inf", "reward.max_failed_steps=0")  # 0: never stop for it
    assert all(r["faults/skipped_update"] == 1 and r["reward/total"] is None for r in rows)
    assert all(r[f"version/{e}"] == 0 for r in rows for e in ("generator", "refiner_0"))
    assert not any(k.startswith("loss/") for r in rows for k in r)


def test_counterfactual_with_a_nan_reward(tmp_path):
    """Counterfactual credit draws each refined sample again without one refinement, and a counting
    prompt's draws score NaN too: its samples are dropped with them, and every expert still trains,
    every step, on the other groups' advantages and D_k, to finite losses."""
    rows = faulty_run(tmp_path, "nan_on_counting", "algorithm.credit=counterfactual")
    assert sum(r["faults/reward_nan"] for r in rows) > 0 and sum(r["faults/dropped_samples"] for r in rows) > 0
    assert all(r["counterfactual/generations"] > 0 and r["faults/skipped_update"] == 0 for r in rows)
    assert all(rows[-1][f"version/{e}"] == 4 for e in ("generator", "refiner_0", "refiner_1", "refiner_2"))
    losses = [v for r in rows for k, v in r.items() if k.startswith("loss/")]
    assert len(losses) >= 4 * 4 and np.isfinite(losses).all()


@pytest.mark.parametrize("fn, says", [("no.such.module:fn", "cannot import"),
                                      ("tests.faulty_rewards:missing", "cannot import"),
                                      ("tests.faulty_rewards:NOT_CALLABLE", "not callable"),
                                      ("just_a_name", "package.module:function")])
def test_a_reward_plugin_that_cannot_be_used_exits_2(fn, says, tmp_path, capsys):
    assert cli.main(["train", "--set", f"reward.terms.image.fn={fn}", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "reward" in err and says in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def failing_run(tmp_path, capsys, image: str, *extra: str, steps: int = 8) -> tuple[int, str, list[dict]]:
    """`jointrl train` of shapes-tiny with the image term `image`: (exit status, stderr, metric rows)."""
    code = cli.main(["train", "--config", "shapes-tiny", "--set", f"reward.terms.image={image}", "--set",
                     f"trainer.steps={steps}", *[a for e in extra for a in ("--set", e)], "--run-dir",
                     str(tmp_path / "run")])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return code, capsys.readouterr().err, [json.loads(line) for line in lines]


def test_a_reward_that_breaks_mid_run_stops_it_after_max_failed_steps_keeping_what_was_trained(tmp_path, capsys):
    """Two steps train, then the image term raises on every sample: three steps in a row without an
    update (reward.max_failed_steps, default 3) checkpoint and stop the run with exit 3, naming the
    term, its failed samples and its last error, and the resume line; resumed with the term fixed,
    the run goes on from what it had trained."""
    code, err, rows = failing_run(tmp_path, capsys, "{fn: 'tests.faulty_rewards:FailsAfter', calls: 2}",
                                  "cluster.mode=inline")
    assert code == cli.REWARDS_FAILED == 3
    assert [r["faults/skipped_update"] for r in rows] == [0, 0, 1, 1, 1]
    assert "stopped after step 5 of 8: the reward failed on every sample of 3 steps in a row" in err
    assert "reward.terms.image failed on 24 of 24 samples (last error: RuntimeError: reward server gone after " \
           "2 calls)" in err  # 3 steps x 2 prompts x group_size 4
    run = tmp_path / "run"
    assert f"resume with: jointrl train --resume {run}" in err
    manifest = json.loads((checkpoint_path(run, 5) / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["versions"]["generator"] == 2  # the two trained steps are kept
    assert cli.main(["train", "--resume", str(run), "--set", "trainer.steps=6",
                     "--set", "reward.terms.image.calls=100"]) == 0
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["version/generator"] == 3


def test_rewards_failing_on_ray_stop_the_run_too(ray_session, tmp_path, capsys):
    code, err, rows = failing_run(tmp_path, capsys, "{fn: 'tests.faulty_rewards:always_raises'}",
                                  "reward.max_failed_steps=2", "experts.n_refiners=1", steps=4)
    assert code == 3 and len(rows) == 2 and all(r["version/generator"] == 0 for r in rows)
    assert "reward.terms.image failed on 16 of 16 samples (last error: RuntimeError: reward server said no)" in err
    assert "resume with: jointrl train --resume" in err
    assert checkpoint_exists(tmp_path / "run", 2)
