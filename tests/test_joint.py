"""The seed test's properties, through the Ray path, plus inline == ray and the CLI contract."""
import json

import numpy as np
import pytest
import yaml

import driver.cli as cli
from experts import state_file
from experts.kinds import build_model
from tests.conftest import make_config, mean, run_training

pytestmark = pytest.mark.usefixtures("ray_session")


def own_gain(rows, expert_id, window=10):
    key = f"reward/{expert_id}"
    return mean(rows[-window:], key) - mean(rows[:window], key)


@pytest.fixture(scope="module")
def per_expert_run(tmp_path_factory, ray_session):
    """24 steps of the default preset, synchronous (the shared-credit run below has its rollouts one
    step ahead of the updates)."""
    cfg = make_config("trainer.steps=24")
    return cfg, *run_training(cfg, tmp_path_factory.mktemp("per_expert"), inspect_weights=("generator",))


@pytest.mark.slow
def test_three_refiners_plus_generator_all_learn_with_per_expert_credit(per_expert_run):
    cfg, rows, info, weights = per_expert_run
    for i in range(3):
        assert own_gain(rows, f"refiner_{i}") > 0.1, f"refiner_{i} did not learn its own term"
    assert rows[-1]["n_experts"] == 4
    init = build_model(cfg, "generator").state_dict()
    assert any(not np.array_equal(weights["generator"][k], v.numpy()) for k, v in init.items())
    assert all(0.5 < r["ppo/ratio_mean"] < 2.0 for r in rows)
    assert {e: v["version"] for e, v in info["experts"].items()} == \
        {"refiner_0": 24, "refiner_1": 24, "refiner_2": 24, "generator": 24}


@pytest.mark.slow
def test_text_encoder_stays_at_v0_and_its_cache_keeps_hitting_across_syncs(per_expert_run):
    cfg, rows, info, _ = per_expert_run
    assert all(r["version/text_encoder"] == 0 for r in rows)
    assert all(w["text_encoder"] == 0 for w in info["workers"])
    # every step synced every expert; once every prompt was seen (an epoch), original prompts (skip
    # samples) still hit the cache
    epoch = cfg.trainer.n_train_prompts // cfg.trainer.prompts_per_step
    assert all(r["text_encoder/cache_hit_rate"] > 0 for r in rows[epoch:])
    assert mean(rows[-10:], "text_encoder/cache_hit_rate") >= mean(rows[:10], "text_encoder/cache_hit_rate")


@pytest.mark.slow
def test_shared_credit_runs_and_versions_stay_independent(tmp_path):
    """Shared credit, experts updated at their own cadence, and rollouts one step ahead of the updates."""
    cfg = make_config("trainer.steps=20", "algorithm.credit=shared", "experts.refiner_1.update_every=2",
                      "experts.generator.update_every=3", "cluster.max_staleness=1")
    rows, info, _ = run_training(cfg, tmp_path)
    assert rows[-1]["credit"] == "shared"
    versions = {e: v["version"] for e, v in info["experts"].items()}
    assert versions == {"refiner_0": 20, "refiner_1": 10, "refiner_2": 20, "generator": 7}
    assert [r["version/refiner_1"] for r in rows[:4]] == [1, 1, 2, 2]  # skipped steps keep the version
    assert all(w == {**versions, "text_encoder": 0} for w in info["workers"])
    assert info["registry"] == versions
    assert max(r["staleness/refiner_0"] for r in rows) == 1  # its samples were drawn a version behind
    assert max(own_gain(rows, f"refiner_{i}") for i in range(3)) > 0.1


@pytest.mark.parametrize("n, mode", [(1, "inline"), (4, "ray")])
def test_scales_to_n_refiners(n, mode, tmp_path):
    cfg = make_config(f"experts.n_refiners={n}", "trainer.steps=1", f"cluster.mode={mode}", preset="shapes-tiny")
    rows, info, _ = run_training(cfg, tmp_path)
    ids = [f"refiner_{i}" for i in range(n)] + ["generator"]
    assert rows[0]["n_experts"] == n + 1
    assert sorted(info["registry"]) == sorted(ids)          # one sync registration per expert
    assert sorted(info["update_targets"]) == sorted(ids)    # N+1 update targets
    assert all(rows[0][f"version/{e}"] == 1 and f"loss/{e}" in rows[0] for e in ids)


def test_generator_only_spawns_no_refiner_and_refines_nothing(tmp_path):
    cfg = make_config("experts.generator_only=true", "trainer.steps=2", preset="shapes-tiny")
    rows, info, _ = run_training(cfg, tmp_path)
    assert sorted(info["experts"]) == ["generator"] and info["update_targets"] == ["generator"]
    assert all(r["n_experts"] == 1 and r["version/generator"] == s + 1 for s, r in enumerate(rows))
    assert all(r["sample/refinements"] == {} and r["reward/format"] == 0.0 for r in rows)
    assert not any(k.startswith(("reward/refiner", "loss/refiner")) for r in rows for k in r)


@pytest.mark.slow
def test_prompt_only_freezes_generator_and_refiners_still_learn(tmp_path):
    """In one process: which experts learn does not depend on where they run."""
    cfg = make_config("trainer.steps=24", "experts.generator.train=false", "cluster.mode=inline")
    rows, info, weights = run_training(cfg, tmp_path, inspect_weights=("generator",))
    init = build_model(cfg, "generator").state_dict()
    assert all(np.array_equal(weights["generator"][k], v.numpy()) for k, v in init.items())
    assert all("loss/generator" not in r and "ppo/ratio_mean" not in r for r in rows)
    assert all(r["version/generator"] == 0 for r in rows) and info["experts"]["generator"]["version"] == 0
    assert "generator" not in info["update_targets"]
    for i in range(3):
        assert own_gain(rows, f"refiner_{i}") > 0.1


def test_inline_equals_ray_with_two_rollout_workers(tmp_path):
    keys = None
    runs = {}
    for mode, workers in (("inline", 1), ("ray", 2)):
        cfg = make_config("trainer.steps=3", f"cluster.mode={mode}", f"cluster.rollout_workers={workers}",
                          preset="shapes-tiny")
        runs[mode], _, _ = run_training(cfg, tmp_path / mode)
    for a, b in zip(runs["inline"], runs["ray"]):
        keys = [k for k in a if k.startswith(("reward/", "loss/", "version/", "kl/", "ppo/"))]
        assert keys and set(keys) <= set(b)
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-6, (k, a[k], b[k])


def test_cli_trains_on_ray_and_writes_the_contract(tmp_path, capsys):
    run_dir = tmp_path / "cli"
    assert cli.main(["train", "--config", "shapes-tiny", "--set", "trainer.steps=2", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert str(run_dir / "metrics.jsonl") in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    ids = ["refiner_0", "refiner_1", "refiner_2", "generator"]
    required = ["step", "n_experts", "credit", "reward/total", "ppo/ratio_mean", "text_encoder/cache_hit_rate",
                "time/step_s", "time/sync_s", "version/text_encoder"]
    required += [f"reward/{t}" for t in ("image", "fidelity", "style", "format")]
    required += [f"{p}/{e}" for e in ids for p in ("version", "loss", "kl", "ppo/ratio_mean")]
    required += [f"reward/{e}" for e in ids[:3]]
    for r in rows:
        assert not set(required) - set(r), set(required) - set(r)
    assert all(abs(rows[0][f"ppo/ratio_mean/{e}"] - 1.0) < 1e-4 for e in ids)  # the first update is on-policy
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["steps"] == 2 and saved["trainer"]["run_name"] == "cli"
    ckpt = run_dir / "checkpoints" / "step_000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["versions"] == {e: 2 for e in ids}
    weights, optimizer, info = state_file.read(ckpt, "generator")
    assert (info.version, info.last_step) == (2, 1) and weights and optimizer["state"]
    assert cli.main(["eval", str(run_dir)]) == 0
    report = json.loads((run_dir / "eval.json").read_text())["sets"]
    for name in ("held_out", "paraphrased"):
        assert set(report[name]) == {"refined", "unrefined"}
        for mode in report[name].values():
            assert set(mode) == {"image", "fidelity", "style", "format", "image/strict"}
            assert set(mode["image/strict"]) == {"single_object", "two_objects", "counting", "colors", "position",
                                                 "color_attr", "overall"}
            assert all(0.0 <= v <= 1.0 for m in mode.values() for v in m.values())
        assert report[name]["unrefined"]["fidelity"]["overall"] == 0.0  # a text term of no refinement
    assert "held_out" in capsys.readouterr().out
