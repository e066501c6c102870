"""`bench/learning.py --quick` runs end to end and writes its report and plot (not that anything wins)."""
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
