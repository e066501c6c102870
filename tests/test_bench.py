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
