"""Host memory of a checkpoint's writer: what writing one expert's snapshot adds to the snapshot it holds.

A stand-in for a widened tiny full fine-tune: a stack of --layers Linear layers of width --width
(fp32, about 4 · width² · layers bytes of weights), one AdamW step, and its snapshot made by the
expert's own functions (`synced_state`, `travel_form`, `optimizer_arrays`), so the writer receives
what it receives from the object store: {name: numpy array} weights and an optimizer of numpy
arrays. In a fresh process the model and its optimizer are freed, the resident memory is read
(the baseline: the snapshot alone, as the writer holds it), and `checkpoint.save` writes it while a
thread samples the resident memory every 2 ms. Reported: the file, the peak above the baseline, and
(snapshot + peak above it) / the largest file (the bar: at most 1.2).

    python bench/checkpoint_writer.py [--width 2048] [--layers 16] [--before <another checkout>] [--json]
`--before` measures that checkout's writer beside this one's, on the same snapshot sizes; `--json`
prints each row as JSON instead of the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURE = r"""
import ctypes, gc, json, sys, tempfile, threading, time
from pathlib import Path
import psutil, torch
from driver import checkpoint
from experts.records import ExpertInfo, Snapshot
from experts.weights import optimizer_arrays, travel_form

width, layers = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model(torch.randn(2, width)).sum().backward()
optimizer.step()
weights = {k: v.numpy().copy() for k, v in travel_form(model.state_dict()).items()}
snapshot = Snapshot(weights, optimizer_arrays(optimizer.state_dict(), private=True), ExpertInfo(1, 0))
del model, optimizer
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
me = psutil.Process()
baseline = me.memory_info().rss
peak, done = baseline, False

def sample():
    global peak
    while not done:
        peak = max(peak, me.memory_info().rss)
        time.sleep(0.002)

watcher = threading.Thread(target=sample)
watcher.start()
with tempfile.TemporaryDirectory() as run_dir:
    start = time.perf_counter()
    ckpt = checkpoint.save(Path(run_dir), 1, {"generator": snapshot})
    seconds = time.perf_counter() - start
    done = True
    watcher.join()
    largest = max(p.stat().st_size for p in Path(ckpt).rglob("*") if p.is_file())
held = sum(v.nbytes for v in weights.values()) + sum(
    v.nbytes for entries in snapshot.optimizer["state"].values() for v in entries.values())
print(json.dumps({"largest": largest, "held": held, "added": peak - baseline, "seconds": seconds}))
"""


def measure(root: Path, width: int, layers: int) -> dict:
    """The writer's figures with the jointrl at `root`, in a fresh process of one thread."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(width), str(layers)], env=env, cwd=root,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--before", type=Path, default=None, help="another checkout, measured beside this one")
    p.add_argument("--json", action="store_true", help="one JSON object per row instead of the table")
    args = p.parse_args()
    rows = [("this checkout", ROOT)] + ([("--before", args.before.resolve())] if args.before else [])
    if not args.json:
        print(f"{'writer':<16}{'largest file MB':>16}{'snapshot MB':>13}{'added MB':>10}{'ratio':>7}{'s':>7}")
    for name, root in rows:
        r = measure(root, args.width, args.layers)
        ratio = (r["held"] + r["added"]) / r["largest"]
        if args.json:
            print(json.dumps({"writer": name, **r, "ratio": ratio}), flush=True)
            continue
        print(f"{name:<16}{r['largest'] / 2**20:>16.0f}{r['held'] / 2**20:>13.0f}{r['added'] / 2**20:>10.0f}"
              f"{ratio:>7.2f}{r['seconds']:>7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
