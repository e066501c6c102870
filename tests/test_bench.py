"""The benches run end to end and write their reports: `bench/learning.py --quick` (with its plot; not
that anything wins) and `bench/rewards.py --quick`."""
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
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, "bench/learning.py", "--quick", "--seeds", "1", "--out", str(out), "--work",
                           str(tmp_path / "runs"), "--set", f"pretrain.out_dir={tmp_path / 'pretrained'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = (out / "learning.md").read_text()
    for method in ("generator_only", "prompt_only", "shared", "per_expert", "counterfactual"):
        assert f"| {method} |" in report
    assert "## Bars" in report and "nan" not in report
    width, height = png_size(out / "learning.png")
    assert width >= 600 and height >= 400
    for run in (tmp_path / "runs").glob("*-seed*"):
        if run.is_dir():
            assert (run / "eval.json").is_file() and (run / "metrics.jsonl").is_file()


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
