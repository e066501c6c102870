"""A reward that raises, hangs or returns NaN/inf: its samples are dropped and counted, the run
finishes, versions only rise and no NaN reaches the weights."""
import numpy as np
import pytest

import driver.cli as cli
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
    rows = faulty_run(tmp_path, "always_inf")
    assert all(r["faults/skipped_update"] == 1 and r["reward/total"] is None for r in rows)
    assert all(r[f"version/{e}"] == 0 for r in rows for e in ("generator", "refiner_0"))
    assert not any(k.startswith("loss/") for r in rows for k in r)


def test_counterfactual_with_a_nan_reward(tmp_path):
    rows = faulty_run(tmp_path, "nan_on_counting", "algorithm.credit=counterfactual")
    assert sum(r["faults/reward_nan"] for r in rows) > 0


@pytest.mark.parametrize("fn, says", [("no.such.module:fn", "cannot import"),
                                      ("tests.faulty_rewards:missing", "cannot import"),
                                      ("tests.faulty_rewards:NOT_CALLABLE", "not callable"),
                                      ("just_a_name", "package.module:function")])
def test_a_reward_plugin_that_cannot_be_used_exits_2(fn, says, tmp_path, capsys):
    assert cli.main(["train", "--set", f"reward.terms.image.fn={fn}", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "reward" in err and says in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
