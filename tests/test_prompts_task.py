"""The `prompts` task end to end on tiny random models of every kind (`prompts-tiny`): a GenEval-format
prompt file, two HF refiners, the tiny SD3 generator and every built-in reward term, with geneval
and pickscore each in a pool of reward actors. Ray equals inline with a reward actor killed mid-run,
a resumed run equals the uninterrupted one, `jointrl eval` writes GenEval's per-tag table and the
images, and a prompt file in Flow-GRPO's one-prompt-per-line OCR format trains as it is."""
import json
import shutil
from importlib.resources import files

import pytest

import driver.cli as cli
from tests.conftest import assert_same_training, looks_like_a_picture, make_config, run_killing

STEPS = ["trainer.steps=4", "trainer.checkpoint_every=2", "evaluation.every=2", "evaluation.max_prompts=6"]
TAGS = {"single_object", "two_object", "counting", "colors", "position", "color_attr"}


def train(run_dir, *sets: str, preset: str = "prompts-tiny") -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    assert cli.main(["train", "--config", preset, *args, "--run-dir", str(run_dir)]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def inline_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("prompts") / "inline"
    return run_dir, train(run_dir, "cluster.mode=inline", *STEPS)


def test_every_term_is_scored_and_logged(inline_run):
    _, rows = inline_run
    cfg = make_config(preset="prompts-tiny")
    assert set(cfg.reward.terms) == {"geneval", "pickscore", "clip_score", "aesthetic", "ocr", "vqa_score",
                                     "format", "length", "faithful"}
    for row in rows:
        assert all(row[f"reward/{t}"] is not None for t in cfg.reward.terms), row
        assert row["faults/dropped_samples"] == 0
    assert rows[-1]["version/generator"] == 4 and rows[-1]["version/refiner_1"] == 4
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [1, 3]
    assert 0.0 <= evals[-1]["eval/geneval/refined/geneval/strict"] <= 1.0


def test_ray_with_two_reward_pools_and_a_killed_reward_actor_equals_inline(inline_run, ray_session, tmp_path):
    _, inline = inline_run
    cfg = make_config(*STEPS, "cluster.rollout_workers=2", preset="prompts-tiny")
    assert cfg.reward.pools().keys() == {"geneval", "pickscore"}
    rows, _ = run_killing(cfg, tmp_path / "ray", [(1, "reward/geneval/0")])  # its pool's only actor: waited for
    assert all(r["faults/dropped_samples"] == 0 for r in rows)                  # and asked again
    assert_same_training(rows, inline, tol=1e-5)  # two workers split the batch: updates round apart by
    # ~1e-7, which PickScore's logit scale (x100/26) carries into the evaluation's scores


def test_a_resumed_run_equals_the_uninterrupted_one(inline_run, tmp_path):
    _, uninterrupted = inline_run
    run_dir = tmp_path / "resumed"
    train(run_dir, "cluster.mode=inline", *STEPS, "trainer.steps=2")
    assert cli.main(["train", "--resume", str(run_dir), "--set", "trainer.steps=4"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert_same_training(rows, uninterrupted)


def test_eval_writes_geneval_per_tag_table_and_the_images(inline_run, capsys):
    run_dir, _ = inline_run
    assert cli.main(["eval", str(run_dir), "--set", "evaluation.max_prompts=null"]) == 0
    out = capsys.readouterr().out
    assert "geneval/strict per tag" in out and "counting" in out
    report = json.loads((run_dir / "eval.json").read_text())["sets"]["geneval"]
    assert set(report) == {"refined", "unrefined"}
    for mode in report.values():
        assert set(mode["geneval/strict"]) == TAGS | {"overall"}
        assert all(set(mode[t]) == TAGS | {"overall"} for t in ("pickscore", "ocr", "faithful"))
        assert all(0.0 <= v <= 1.0 for v in mode["geneval/strict"].values())
    assert report["unrefined"]["format"]["overall"] == 0.0  # nothing refined, nothing formatted
    looks_like_a_picture(run_dir / "eval_samples.png", min_size=(100, 100))
    looks_like_a_picture(run_dir / "eval_sheet.png")
    assert cli.main(["eval", str(run_dir), "--no-refine"]) == 0
    assert set(json.loads((run_dir / "eval.json").read_text())["sets"]["geneval"]) == {"unrefined"}


def test_a_flow_grpo_ocr_prompt_file_trains_and_evaluates_as_it_is(tmp_path):
    data = files("configs").joinpath("data")
    for name in ("ocr-tiny-train.txt", "ocr-tiny-eval.txt"):
        shutil.copy(str(data.joinpath(name)), tmp_path / name)
    run_dir = tmp_path / "ocr"
    rows = train(run_dir, "cluster.mode=inline", "trainer.steps=2", f"task.train={tmp_path / 'ocr-tiny-train.txt'}",
                 f"task.eval={tmp_path / 'ocr-tiny-eval.txt'}",
                 'reward.terms={ocr: {fn: ocr, threads: 1}, faithful: {fn: faithful, weight: 0.5}}',  # PP-OCRv4
                 "experts.refiner_0.owns=[faithful]", "experts.refiner_1.owns=[faithful]")
    assert all(r["reward/ocr"] is not None for r in rows)
    assert cli.main(["eval", str(run_dir)]) == 0
    report = json.loads((run_dir / "eval.json").read_text())["sets"]["eval"]["refined"]
    assert set(report) == {"ocr", "faithful"} and set(report["ocr"]) == {"overall"}  # no tags in a .txt file


@pytest.mark.parametrize("bad, says", [
    ("task.train=no/such/prompts.jsonl", "no such file"),
    ("task.eval={geneval: TRAIN}", "shares 24 prompt(s) with task.train"),
])
def test_bad_prompt_sources_exit_2_naming_them(bad, says, tmp_path, capsys):
    train_file = str(files("configs").joinpath("data", "geneval-tiny-train.jsonl"))
    assert cli.main(["train", "--config", "prompts-tiny", "--set", bad.replace("TRAIN", train_file),
                     "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_a_bad_line_in_a_prompt_file_is_named(tmp_path, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "a photo of a cat", "tag": "single_object"}\n{"prompt": "a dog"\n')
    assert cli.main(["train", "--config", "prompts-tiny", "--set", f"task.train={bad}",
                     "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "task.train" in err and str(bad) in err and "line 2" in err
