"""The benches run end to end and write their reports: `bench/learning.py --quick` (with its plot; not
that anything wins) and `bench/rewards.py --quick`."""
import json
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert zlib.crc32(data[12:29]) == int.from_bytes(data[29:33], "big")  # an intact header chunk
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.slow
def test_learning_bench_quick_writes_report_and_plot(tmp_path):
    """Three of its methods, a few steps each, from the shipped base: every run's evaluations are in
    its metrics, its lever measured on the frozen base, and the report's rows are those runs'; the
    transfer study draws generator-only's final generator from the original prompts as its last
    evaluation did."""
    out, work = tmp_path / "results", tmp_path / "runs"
    done = subprocess.run([sys.executable, "bench/learning.py", "--quick", "--out", str(out), "--work", str(work),
                           "--methods", "promptrl_counterfactual", "per_expert", "--transfer-study"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = (out / "learning.md").read_text()
    lines = report.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| method |"))
    table = [[cell.strip() for cell in line.strip("|").split("|")]
             for line in lines[first:lines.index("", first)] if "---" not in line]
    header, rows = table[0], {row[0]: row for row in table[1:]}
    assert list(rows) == ["generator_only", "promptrl_counterfactual", "per_expert"]
    assert "## Bars" in report and "best joint method, promptrl_counterfactual" in report and "nan" not in report
    evals_of = {}
    for method in ("generator_only", "promptrl_counterfactual", "per_expert"):
        metrics = [json.loads(line) for line in (work / f"{method}-seed0" / "metrics.jsonl").read_text().splitlines()]
        mode = "unrefined" if method == "generator_only" else "refined"
        evals = [r[f"eval/held_out/{mode}/image/strict"] for r in metrics if "eval/held_out/unrefined/image/strict" in r]
        assert len(evals) == 2 and all(0 <= v <= 1 for v in evals)
        evals_of[method] = evals
        lever = json.loads((work / f"{method}-seed0" / "lever.json").read_text())
        assert ("trained_refiners" in lever) == (method != "generator_only")
        start = lever["base_unrefined" if method == "generator_only" else "base_refiners"]["held_out"]
        # the mean of the last three points: the base, two evaluations
        final = float(rows[method][header.index("final strict held-out")])
        assert final == pytest.approx((start + sum(evals)) / 3, abs=5e-4)
    transfer = json.loads((work / "generator_only-seed0" / "transfer.json").read_text())
    assert set(transfer) == {"unrefined", "base_refiners", "promptrl_counterfactual"}  # per_expert: text terms
    assert transfer["unrefined"]["held_out"] == pytest.approx(evals_of["generator_only"][-1], abs=1e-9)
    assert "| promptrl_counterfactual's trained refiners |" in report
    width, height = png_size(out / "learning.png")
    assert width >= 1000 and height >= 400
    # tuning a method: generator-only, the reference, is reused; the tuned runs have their own folder
    untuned = (work / "promptrl_counterfactual-seed0" / "metrics.jsonl").read_bytes()
    tune = ["--tune", "experts.refiner_0.lr=0.001", "--methods", "promptrl_counterfactual"]
    done = subprocess.run([sys.executable, "bench/learning.py", "--quick", "--out", str(tmp_path / "tuned"),
                           "--work", str(work), *tune], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "(1 of 2 runs reused" in (tmp_path / "tuned" / "learning.md").read_text()
    tuned = next(work.glob("promptrl_counterfactual+*-seed0"))
    assert "experts.refiner_0.lr=0.001" in json.loads((tuned / "bench_sets.json").read_text())["sets"]
    assert (work / "promptrl_counterfactual-seed0" / "metrics.jsonl").read_bytes() == untuned
    refused = subprocess.run([sys.executable, "bench/learning.py", "--quick", *tune, "--transfer-study"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--transfer-study" in refused.stderr


def test_a_run_is_reused_only_if_made_by_the_same_code_from_the_same_base(tmp_path, monkeypatch):
    """bench/learning.py's digest covers every file of algorithm/, experts/, tasks/, common/ and every
    file a run starts from; a run whose marker names other settings, another digest, or none (an
    older run's bare list of settings) is not finished."""
    sys.path.insert(0, str(ROOT / "bench"))
    import learning
    from driver.config import resolve_config
    tree = tmp_path / "tree"
    for folder in learning.CODE:
        (tree / folder / "__pycache__").mkdir(parents=True)
        (tree / folder / "module.py").write_text(f"# {folder}\n")
    base = tmp_path / "base.safetensors"
    base.write_bytes(b"weights")
    monkeypatch.setattr(learning, "ROOT", tree)
    config = resolve_config("shapes", ["experts.base=null", f"experts.generator.init={base}"])
    digest = learning.code_digest(config)
    (tree / "experts" / "__pycache__" / "module.cpython.pyc").write_bytes(b"compiled")  # not code
    assert learning.code_digest(config) == digest
    (tree / "tasks" / "module.py").write_text("# tasks, changed\n")
    changed_code = learning.code_digest(config)
    base.write_bytes(b"other weights")
    changed_base = learning.code_digest(config)
    (tree / "common" / "new.py").write_text("")
    assert len({digest, changed_code, changed_base, learning.code_digest(config)}) == 4
    run = tmp_path / "run"
    run.mkdir()
    sets = ["trainer.seed=0"]
    (run / "bench_sets.json").write_text(json.dumps({"sets": sets, "code": digest}))
    assert learning.finished(run, sets, digest)
    assert not learning.finished(run, sets, changed_code) and not learning.finished(run, ["trainer.seed=1"], digest)
    (run / "bench_sets.json").write_text(json.dumps(sets))  # made before the digest was recorded
    assert not learning.finished(run, sets, digest)


def test_the_text_study_verdict_compares_each_pair_by_a_measure_that_tells_them_apart():
    """Where neither of two methods reaches generator-only's final accuracy, their x are both the
    capped budget: the pair is compared by x 80%, and where that is capped too, by final accuracy."""
    sys.path.insert(0, str(ROOT / "bench"))
    from learning import text_study_verdict

    def method(ratio, missed, gain, missed_gain, held):
        return {"ratio": ratio, "missed": missed, "ratio_gain": gain, "missed_gain": missed_gain, "held": held}
    capped = [1.5, 1.5]
    stats = {"counterfactual": method(capped, 2, [1.0, 2.0], 1, [0.80, 0.82]),
             "per_expert": method(capped, 2, [3.0, 3.0], 2, [0.78, 0.80]),
             "shared": method(capped, 2, [3.0, 3.0], 2, [0.75, 0.77])}
    verdict = text_study_verdict(stats)
    assert verdict.startswith("- text-term study, counterfactual >= per_expert > shared: met")
    assert "by x 80%, counterfactual >= 1.50" in verdict and "by final strict held-out, shared 0.760" in verdict
    stats["shared"]["held"] = [0.80, 0.80]  # shared ahead where both are capped: missed
    assert ": missed (" in text_study_verdict(stats)
    stats["per_expert"] = method([1.0, 1.5], 1, [1.0, 1.0], 0, [0.9, 0.9])  # per_expert reaches: x decides
    verdict = text_study_verdict(stats)
    assert ": met (" not in verdict and "by x generator-only, counterfactual >= 1.50 ± 0.00 (2/2" in verdict


@pytest.mark.cluster  # it starts the command, or a Ray, in a process of its own
def test_rewards_bench_quick_writes_both_ratios(tmp_path):
    """`bench/rewards.py --quick` runs (tiny reward models, a local Ray with reward pools) and writes
    its report with a ratio per term and per pool measurement; no timing is asserted."""
    out = tmp_path / "rewards.md"
    done = subprocess.run([sys.executable, "bench/rewards.py", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = out.read_text()
    ratio = r"\| \d+\.\d+× \|"
    for term in ("geneval", "pickscore", "clip_score", "aesthetic", "ocr", "vqa_score"):
        assert re.search(rf"^\| {term} \| \d+\.\d+ ms \| \d+\.\d+ ms {ratio}", report, re.M), term
    assert re.search(rf"^\| sleep 0\.5 s \+ sleep 0\.3 s \|.*{ratio} ≤ 1\.2 \|", report, re.M)
    assert re.search(rf"^\| geneval \+ pickscore .*{ratio}", report, re.M)
    assert report.count("Bar (") == 2 and not re.search(r"\bnan\b", report)


def _run(curve: list[float], rare: list[float], mode: str, zero_std: tuple[float, float]) -> dict:
    """A run as bench/learning.py's `load` reads it: evaluations every 640 rollouts."""
    import numpy as np
    sets = {"held_out": curve, "paraphrased": curve, "rare_wording": rare}
    curves = {f"{name}/{m}": np.array(values) for name, values in sets.items() for m in {mode, "unrefined"}}
    lever = {"base_unrefined": {name: values[0] for name, values in sets.items()}}
    if mode == "refined":
        lever |= {"base_refiners": lever["base_unrefined"], "trained_refiners": {n: v[0] + 0.05 for n, v in sets.items()}}
    return {"rollouts": np.arange(len(curve)) * 640, "curve": curves, "mode": mode,
            "step_rollouts": np.arange(1, 11) * 64, "reward": np.full(10, 0.9), "lever": lever, "extra": 0,
            "step_s": 1.0, "diagnostics": {"groups/zero_std/image": zero_std, "groups/reward_std": (0.1, 0.05),
                                           "groups/similarity": (0.9, 0.95)}}


def test_the_shapes_low_diversity_preset_is_the_benchmark_cell_it_reports():
    """configs/shapes-low-diversity.yaml is bench/settings.py's low_diversity setting under
    promptrl_counterfactual, every key; with experts.generator_only=true it is that setting's
    generator-only run (bar the refiners' KL, which a run without refiners never reads)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import learning
    import settings

    from driver.preflight import load_config
    cell = [*learning.BENCH, *settings.SETTINGS["low_diversity"]]
    joint = load_config("shapes", [*cell, *learning.REFINERS, *learning.METHODS["promptrl_counterfactual"]])
    assert load_config("shapes-low-diversity").model_dump() == joint.model_dump()
    alone = load_config("shapes", [*cell, *learning.METHODS["generator_only"]]).model_dump()
    preset_alone = load_config("shapes-low-diversity", ["experts.generator_only=true"]).model_dump()
    assert preset_alone["experts"]["generator"] == alone["experts"]["generator"]
    assert preset_alone["trainer"] == alone["trainer"] and preset_alone["evaluation"] == alone["evaluation"]
    assert preset_alone["reward"]["terms"]["image"] == alone["reward"]["terms"]["image"]


@pytest.mark.slow
def test_the_settings_bench_says_where_joint_rl_wins_by_the_bar_and_why(tmp_path):
    """bench/settings.py's figures and verdicts on runs whose curves are known: a joint method that
    reaches generator-only's final accuracy in a third of its rollouts and loses less to the rare
    wording wins; one that never reaches it does not; the report's table has a row per cell."""
    sys.path.insert(0, str(ROOT / "bench"))
    import settings
    gen = [0.5, 0.6, 0.7, 0.8, 0.8, 0.8]  # final 0.8, reached (two evaluations averaging it) at 2560
    fast = [0.5, 0.8, 0.85, 0.85, 0.85, 0.85]  # the first two evaluations averaging >= 0.8 end at 1280
    slow = [0.5, 0.55, 0.6, 0.6, 0.6, 0.6]
    runs = {"generator_only": {s: _run(gen, [v - 0.2 for v in gen], "unrefined", (0.6, 0.4)) for s in (0, 1)},
            "promptrl_replace": {s: _run(fast, [v - 0.05 for v in fast], "refined", (0.1, 0.2)) for s in (0, 1)},
            "promptrl_counterfactual": {s: _run(slow, slow, "refined", (0.1, 0.2)) for s in (0, 1)}}
    stats, _ = settings.cell_stats(runs)
    assert list(stats["promptrl_replace"]["ratio"]) == [0.5, 0.5]  # 1280 of generator-only's 2560
    assert stats["promptrl_counterfactual"]["missed"] == 2
    assert stats["generator_only"]["rare_drop"] == pytest.approx([0.2, 0.2])
    assert stats["promptrl_replace"]["diagnostics"]["groups/zero_std/image"] == (0.1, 0.2)
    # on the rare wording generator-only reaches its final 0.6 at 2560, the fast one at 640, the slow one at 1920
    assert list(stats["promptrl_replace"]["rare_ratio"]) == [0.25, 0.25]
    assert list(stats["promptrl_counterfactual"]["rare_ratio"]) == [0.75, 0.75]
    text = settings.verdict("rare_wording", stats)
    assert "promptrl_replace, needs 0.50x ± 0.00" in text and "generator-only drops 0.200" in text
    assert "promptrl_replace reaches generator-only's final accuracy there with 0.25x ± 0.00 of its rollouts: " \
           "the bar's measure met on that set." in text
    assert "**wins**" in text
    stats["promptrl_replace"]["rare_drop"] = [0.3, 0.3]  # reaches the target, but loses more to rare words
    assert "does not win" in settings.verdict("rare_wording", stats)
    one_seed = {m: {0: r[0]} for m, r in runs.items()}
    assert "needs more seeds" in settings.verdict("rare_wording", settings.cell_stats(one_seed)[0])
    lost = {m: dict(r) for m, r in runs.items() if m != "promptrl_replace"}
    assert "does not win" in settings.verdict("control", settings.cell_stats(lost)[0])
    cells = {"control": settings.cell_stats(lost), "rare_wording": settings.cell_stats(runs)}
    meta = {"quick": False, "flags": "", "date": "2026-12-06", "reused": 0, "minutes": 1.0, "runs": 5, "seeds": 2,
            "steps": 10, "per_step": 64, "per_category": 100, "every": 10, "bench": ["trainer.steps=10"]}
    assert "is not measured here" in settings.verdict("low_diversity", {m: {**st, "rare": [], "rare_drop": []}
                                                                       for m, st in stats.items()})
    settings.write_report(tmp_path / "settings.md", cells, meta, list(settings.COMPARED))
    report = (tmp_path / "settings.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| control |") or line.startswith("| rare_wording |")]
    assert len(rows) == 5 and "| rare_wording | generator_only | 1.00 ± 0.00 | 0.800 ± 0.000 | 0.600 ± 0.000 |" in report
    assert "0.60 → 0.40" in report and "nan" not in report
    assert "| 0.050 ± 0.000 | 0.25 ± 0.00 |" in report  # replace's drop to rare, then its x on the rare wording
    settings.plot(tmp_path / "settings.png", cells, {"control": lost, "rare_wording": runs})
    assert png_size(tmp_path / "settings.png")[0] >= 800
