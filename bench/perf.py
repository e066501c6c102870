"""Performance of the service, every figure a ratio of runs measured side by side in this run.

overhead: step time of `ray` against `inline` for the same config (1 rollout worker), and the
          rollout phase (step - update - sync, as the driver sees it) with 2 workers against 1, at
          the default batch (32 samples) and at 128 samples per step.
async:    step time at `cluster.max_staleness=1` against 0 with rollout and update balanced:
          generator-only, plus a reward model of fixed cost (bench/scored_reward.py) whose cost
          is calibrated here so that the rollout takes as long as the update.
scaling:  N = 1, 2, 4, 8 refiners (plus the generator) whose update sleeps a fixed time instead of
          computing: the N+1 updates run concurrently, so the step should not grow with N.
sync:     bench/sync.py (weights to W workers against the memcpy bound and naive transfer; memory).
Prints each table and writes bench/results/perf.md (`make bench`).
Usage: python bench/perf.py [--quick] [--skip-sync] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from bench.scored_reward import score  # noqa: E402
from cluster.expert_actor import ExpertActor  # noqa: E402
from cluster.runtime import get  # noqa: E402
from driver.preflight import load_config  # noqa: E402
from driver.launch import start_driver, stop_driver  # noqa: E402

SCORED = ["reward.terms.scorer={fn: bench.scored_reward:scorer_term, weight: 0.0}"]


class SleepyExpert(ExpertActor):
    """An expert whose update sleeps `SLEEP_S` instead of computing, and still bumps its version."""
    SLEEP_S = 1.0

    def apply(self, step: int, advantages, shards) -> dict:
        time.sleep(self.SLEEP_S)
        return {"loss": 0.0, "kl": 0.0, "ratio_mean": 1.0, "grad_norm": 0.0}


def train(work: Path, name: str, overrides: list[str], preset: str = "shapes", expert_cls=ExpertActor) -> list[dict]:
    """Run a config to completion on the Ray started here (or in-process if it says inline)."""
    cfg = load_config(preset, overrides)
    cfg.trainer.run_name = f"perf-{name}-{time.time_ns()}"
    run_dir = work / name
    driver = start_driver(cfg, run_dir, expert_cls=expert_cls)
    try:
        get(driver.run.remote())
    finally:
        stop_driver(driver)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def median(rows: list[dict], key, warm: int) -> float:
    """Median of `key` (a metric name, or a function of a row) over the steps after `warm`."""
    values = [key(r) if callable(key) else r[key] for r in rows[warm:]]
    return statistics.median(values)


def rollout_phase(row: dict) -> float:
    return row["time/step_s"] - row["time/update_s"] - row["time/sync_s"]


def overhead(work: Path, steps: int, warm: int) -> list[tuple]:
    """ray against inline at the default batch; 2 rollout workers against 1 at the default batch
    (4 prompts x 8 = 32 samples, where each worker's fixed per-token and per-step costs weigh) and
    at 16 prompts x 8 = 128 samples, where generation dominates."""
    base = [f"trainer.steps={steps}"]
    inline = train(work, "inline", [*base, "cluster.mode=inline"])
    one = train(work, "ray-1", [*base, "cluster.rollout_workers=1"])
    two = train(work, "ray-2", [*base, "cluster.rollout_workers=2"])
    big = [f"trainer.steps={min(steps, 8)}", "trainer.prompts_per_step=16"]
    one_big = train(work, "ray-1-big", [*big, "cluster.rollout_workers=1"])
    two_big = train(work, "ray-2-big", [*big, "cluster.rollout_workers=2"])
    step_in, step_ray = median(inline, "time/step_s", warm), median(one, "time/step_s", warm)
    rows = [("step time, ray / inline (1 worker)", f"{step_ray:.3f} s / {step_in:.3f} s", step_ray / step_in,
             "≤ 1.15", step_ray / step_in <= 1.15)]
    for label, a, b in (("32 samples per step", one, two), ("128 samples per step", one_big, two_big)):
        phase_1, phase_2 = median(a, rollout_phase, warm), median(b, rollout_phase, warm)
        rows.append((f"rollout phase, 1 worker / 2 workers, {label}", f"{phase_1:.3f} s / {phase_2:.3f} s",
                     phase_1 / phase_2, "≥ 1.6", phase_1 / phase_2 >= 1.6))
    return rows


def start_ray(passes: int) -> None:
    """A local Ray whose actors see JOINTRL_SCORER_PASSES=`passes` (the reward model's cost)."""
    os.environ["JOINTRL_SCORER_PASSES"] = str(passes)
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="jointrl", _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"JOINTRL_SCORER_PASSES": str(passes), "PYTHONPATH": str(ROOT)}})


def balanced_passes(work: Path, steps: int, warm: int) -> int:
    """Scorer passes that make the generator-only rollout, as it runs in a Ray worker, take as long
    as the update: a first guess from an inline run without the scorer and the scorer's cost timed
    here, then one Ray run with that guess, from which the cost per pass is taken as measured."""
    base = [f"trainer.steps={steps}", "experts.generator_only=true", *SCORED]
    os.environ["JOINTRL_SCORER_PASSES"] = "0"
    rows = train(work, "calibrate-0", [*base, "cluster.mode=inline"])
    bare = median(rows, "time/rollout_s", warm)
    update = median(rows, "time/update_s", warm)
    cfg = load_config("shapes")
    images = np.zeros((cfg.trainer.prompts_per_step * cfg.algorithm.group_size, 3, cfg.task.image_size,
                       cfg.task.image_size), np.float32)
    score(images, 2)  # warm
    start = time.perf_counter()
    score(images, 10)
    guess = max(1, round((update - bare) / ((time.perf_counter() - start) / 10)))
    start_ray(guess)
    try:
        rows = train(work, "calibrate-1", [*base, "cluster.max_staleness=0"])
    finally:
        ray.shutdown()
    rollout, update = median(rows, "time/rollout_s", warm), median(rows, "time/update_s", warm)
    per_pass = max(rollout - bare, 1e-6) / guess
    passes = max(0, round((update - bare) / per_pass))
    print(f"scorer calibrated: {guess} passes gave rollout {rollout:.3f} s against update {update:.3f} s; "
          f"using {passes}")
    return passes


def asynchronous(work: Path, steps: int, warm: int, passes: int) -> list[tuple]:
    base = [f"trainer.steps={steps}", "experts.generator_only=true", *SCORED]
    start_ray(passes)
    try:
        sync = train(work, "sync", [*base, "cluster.max_staleness=0"])
        ahead = train(work, "async", [*base, "cluster.max_staleness=1"])
    finally:
        ray.shutdown()
    s0, s1 = median(sync, "time/step_s", warm), median(ahead, "time/step_s", warm)
    r0, u0 = median(sync, "time/rollout_s", warm), median(sync, "time/update_s", warm)
    i0, i1 = median(sync, "time/idle_s", warm), median(ahead, "time/idle_s", warm)
    return [("balance in the synchronous run, rollout / update", f"{r0:.3f} s / {u0:.3f} s", r0 / u0, "≈ 1", None),
            ("step time, staleness 1 / staleness 0", f"{s1:.3f} s / {s0:.3f} s", s1 / s0, "≤ 0.7", s1 / s0 <= 0.7),
            ("workers idle per step, staleness 1 / staleness 0", f"{i1:.3f} s / {i0:.3f} s", i1 / max(i0, 1e-9),
             "", None)]


def scaling(work: Path, steps: int, warm: int, sizes: list[int]) -> list[tuple]:
    out, first = [], None
    for n in sizes:
        rows = train(work, f"scale-{n}", [f"trainer.steps={steps}", f"experts.n_refiners={n}",
                                          "algorithm.credit=shared"], preset="shapes-tiny", expert_cls=SleepyExpert)
        step_s, update_s = median(rows, "time/step_s", warm), median(rows, "time/update_s", warm)
        first = first or step_s
        out.append((f"N = {n}: {n + 1} updates of {SleepyExpert.SLEEP_S:.1f} s", f"step {step_s:.3f} s, "
                    f"update phase {update_s:.3f} s", step_s / first, "≤ 1.3 at N = 8" if n == 8 else "",
                    step_s / first <= 1.3 if n == 8 else None))
    return out


def table(title: str, rows: list[tuple], note: str) -> list[str]:
    lines = [f"## {title}", "", note, "", "| measured | times | ratio | bar | met |", "|---|---|---|---|---|"]
    lines += [f"| {what} | {times} | {ratio:.2f}× | {bar} | {'' if met is None else ('yes' if met else '**no**')} |"
              for what, times, ratio, bar, met in rows]
    return [*lines, ""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="few steps, N = 1 and 2, sync --quick (a smoke run)")
    p.add_argument("--skip-sync", action="store_true", help="leave out bench/sync.py")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "perf.md"))
    args = p.parse_args()
    steps, warm = (4, 1) if args.quick else (14, 2)
    sizes = [1, 2] if args.quick else [1, 2, 4, 8]
    torch.set_num_threads(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sections = []
    with tempfile.TemporaryDirectory(prefix="jointrl-perf-") as tmp:
        work = Path(tmp)
        start_ray(0)
        try:
            sections.append(table("Overhead", overhead(work, steps, warm),
                                  f"Preset `shapes`, {steps} steps (8 at 128 samples per step), medians "
                                  f"after {warm}. At 32 samples per step a worker's fixed costs per token and "
                                  f"per sampling step (the same for 16 samples as for 32) limit what a second "
                                  f"worker saves."))
            sections.append(table("Scaling by simulation", scaling(work, steps, warm, sizes),
                                  f"Preset `shapes-tiny` with N refiners, shared credit; every update sleeps "
                                  f"{SleepyExpert.SLEEP_S:.1f} s. Ratios are against N = 1."))
        finally:
            ray.shutdown()
        passes = balanced_passes(work, steps, warm)
        sections.append(table("Async rollouts", asynchronous(work, steps, warm, passes),
                              f"Generator-only `shapes` plus a reward model of {passes} scorer passes "
                              f"(calibrated here so that the rollout takes as long as the update), {steps} "
                              f"steps, medians after {warm}."))
    if not args.skip_sync:  # bench/sync.py's table, into a file of this run's: sync.md is sync.py's own
        with tempfile.TemporaryDirectory(prefix="jointrl-perf-sync-") as tmp:
            sync_md = Path(tmp) / "sync.md"
            subprocess.run([sys.executable, str(ROOT / "bench" / "sync.py"), "--out", str(sync_md),
                            *(["--quick"] if args.quick else [])], check=True, stdout=subprocess.DEVNULL)
            sections.append(["## Weight sync and memory", "", sync_md.read_text().split("\n", 2)[2]])
    head = [f"# Performance (`python bench/perf.py{' --quick' if args.quick else ''}`, {time.strftime('%Y-%m-%d')}, "
            f"{os.cpu_count()} cores, local Ray)", ""]
    text = "\n".join(head + [line for s in sections for line in s]) + "\n"
    print(text)
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
