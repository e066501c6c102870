"""`shapes-video` learning: the preset's 40-step run from its shipped base, on several seeds.

Each seed trains the `shapes-video` preset through the `jointrl` CLI (inline, one thread, the
preset's settings but `trainer.seed`), and the script compares the mean of the first 10 steps
with the mean of the last 10 for the generator's term (`reward/video`) and each refiner's own
reward (`reward/refiner_<i>`: the mean of the text terms it owns), per seed and over seeds. The
training prompts cycle every 10 steps (`trainer.n_train_prompts` 40 at 4 per step), so the first
and last 10 steps see the same prompts. A finished run made with the same settings by the same
code and base is reused. Usage:
  python bench/learning_video.py [--seeds 5] [--steps 40] [--jobs 1] [--work DIR] [--out DIR]
The script writes learning-video.md in --out and nothing else there.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from driver.preflight import load_config  # noqa: E402

PRESET = "shapes-video"
WINDOW = 10  # steps averaged at each end
CODE = ["algorithm", "experts", "tasks", "driver", "cluster", "common", f"configs/{PRESET}.yaml"]


def code_digest(config) -> str:
    """A hash of the code a run is made by and of every file it starts from (the base)."""
    files = sorted(p for entry in CODE for p in ([ROOT / entry] if (ROOT / entry).is_file()
                                                 else (ROOT / entry).rglob("*.py")))
    inits = {s.init for s in [*config.experts.sections().values(), config.experts.text_encoder] if s.init}
    digest = hashlib.sha256()
    for path, name in [*((p, p.relative_to(ROOT)) for p in files), *((Path(f), Path(f).name) for f in sorted(inits))]:
        data = path.read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:16]


def run_one(seed: int, steps: int, work: Path, code: str) -> Path:
    """Train seed `seed` with the CLI, inline on one thread; reused when already made alike."""
    run_dir = work / f"seed{seed}"
    sets = [f"trainer.seed={seed}", f"trainer.steps={steps}", "cluster.mode=inline", "logging.report=false"]
    marker = run_dir / "bench_sets.json"
    if marker.is_file() and json.loads(marker.read_text()) == {"sets": sets, "code": code}:
        return run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "driver", "train", "--config", PRESET, "--run-dir", str(run_dir),
           *[a for s in sets for a in ("--set", s)]]
    with open(work / f"seed{seed}.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode:
            raise RuntimeError(f"seed {seed} failed; see {work / f'seed{seed}.log'}")
    marker.write_text(json.dumps({"sets": sets, "code": code}))
    print(f"bench: seed {seed} done in {time.perf_counter() - start:.0f} s", flush=True)
    return run_dir


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def first_last(rows: list[dict], key: str) -> tuple[float, float]:
    """Mean of `key` over the first and the last WINDOW steps (steps where it was not logged left out)."""
    def mean(part):
        values = [r[key] for r in part if r.get(key) is not None]
        return float(np.mean(values)) if values else float("nan")
    return mean(rows[:WINDOW]), mean(rows[-WINDOW:])


def measures(config) -> list[tuple[str, str]]:
    """(metric, what it is) of the table: the generator's term, then each refiner's own reward."""
    owns = {eid: r.owns for eid, r in config.experts.active_refiners().items()}
    return [("reward/video", "generator's term"), *((f"reward/{e}", "own: " + ", ".join(t)) for e, t in owns.items())]


def report(config, runs: dict[int, Path], steps: int, seconds: float) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    base = Path(config.experts.generator.init).parent.name
    lines = [f"# `{PRESET}` learning: first {WINDOW} against last {WINDOW} steps", "",
             f"Written by `python bench/learning_video.py --seeds {len(runs)} --steps {steps}` on {stamp} in "
             f"{seconds / 60:.1f} min (inline, one thread per run, on two shared cores). Each seed trains the "
             f"`{PRESET}` preset from its base `{base}` for {steps} steps of "
             f"{config.trainer.prompts_per_step * config.algorithm.group_size} clips "
             f"({config.task.num_frames} frames, {config.task.image_size} px). Values are the mean of the metric over "
             f"the first and the last {WINDOW} steps; rise = last - first.", "",
             "| metric | seed | first 10 | last 10 | rise |", "|---|---|---|---|---|"]
    summary = ["", "## Over seeds", "", "| metric | what | first 10 | last 10 | rise (mean ± sd) | seeds rising |",
               "|---|---|---|---|---|---|"]
    for key, what in measures(config):
        pairs = {seed: first_last(rows_of(run), key) for seed, run in runs.items()}
        for seed, (a, b) in pairs.items():
            lines.append(f"| {key} | {seed} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
        first, last = np.array([p[0] for p in pairs.values()]), np.array([p[1] for p in pairs.values()])
        rise = last - first
        summary.append(f"| {key} | {what} | {first.mean():.3f} | {last.mean():.3f} | {rise.mean():+.3f} ± "
                       f"{rise.std():.3f} | {int((rise > 0).sum())}/{len(rise)} |")
    return "\n".join(lines + summary) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-learning-video"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    config = load_config(PRESET)
    code = code_digest(config)
    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda s: run_one(s, args.steps, Path(args.work), code), range(args.seeds)))
    out = Path(args.out) / "learning-video.md"
    out.write_text(report(config, dict(enumerate(dirs)), args.steps, time.perf_counter() - start))
    print(f"bench: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
