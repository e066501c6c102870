"""Chaos: a run of K steps on local Ray with random faults of every kind at random moments.

Faults: an expert, a rollout worker or the weight-sync actor killed (`ray.kill`, restart allowed),
and a reward that raises, returns NaN or hangs past `reward.timeout_s` on some samples. It prints
the faults injected and survived, steps lost, duplicate updates and version regressions (each must
be 0), and the slowdown against a fault-free run of the same config, measured in the same process.
Usage: python bench/chaos.py [--steps 40] [--kill-every 1.0] [--seed 0]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from cluster.runtime import get  # noqa: E402
from driver.config import load_config  # noqa: E402
from driver.launch import start_driver  # noqa: E402
from tasks.reward import shapes_reward  # noqa: E402

FAULT_LOG = "JOINTRL_CHAOS_LOG"


def flaky_reward(images, prompts, refinements, owners):
    """The shapes reward, except for ~3% of samples (chosen by a hash of the image, so a retried
    sample fails the same way): it raises, returns NaN, or hangs past the timeout."""
    terms = shapes_reward(images, prompts, refinements, owners)
    for i, image in enumerate(images):
        roll = int(hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest()[:8], 16) % 1000
        kind = "raise" if roll < 10 else "nan" if roll < 20 else "hang" if roll < 25 else None
        if kind is None:
            continue
        with open(os.environ[FAULT_LOG], "a") as log:
            log.write(f"{kind} {roll} {i} {prompts[i].text}\n")
        if kind == "raise":
            raise RuntimeError("chaos: the reward model crashed")
        if kind == "hang":
            time.sleep(1.5)
        terms["image"][i] = np.nan
    return terms


def config(steps: int, run_name: str, chaos: bool):
    sets = [f"trainer.steps={steps}", "cluster.rollout_workers=2", "cluster.max_restarts=1000"]
    if chaos:
        sets += ["reward.fn=chaos:flaky_reward", "reward.timeout_s=0.5"]
    cfg = load_config("shapes-tiny", sets)
    cfg.trainer.run_name = run_name
    return cfg


def kill_loop(run_name: str, targets: list[str], every: float, rng: random.Random, stop: threading.Event,
              log: list) -> None:
    """Kill a random actor of the run at exponentially spaced moments until `stop`."""
    while not stop.wait(rng.expovariate(1 / every)):
        target = rng.choice(targets)
        try:
            ray.kill(ray.get_actor(f"{run_name}/{target}", namespace="jointrl"), no_restart=False)
            log.append((time.perf_counter(), target))
        except ValueError:  # not registered right now (restarting): nothing was killed
            pass


def train(cfg, run_dir: Path, kill_every: float | None, seed: int) -> tuple[list[dict], list, float]:
    targets = [f"expert/{e}" for e in cfg.experts.ids()] + ["rollout/0", "rollout/1", "weight_sync"]
    start = time.perf_counter()
    driver = start_driver(cfg, run_dir)
    kills, stop = [], threading.Event()
    killer = threading.Thread(target=kill_loop, args=(cfg.trainer.run_name, targets, kill_every, random.Random(seed),
                                                      stop, kills)) if kill_every else None
    if killer:
        killer.start()
    try:
        get(driver.run.remote())
    finally:
        stop.set()
        if killer:
            killer.join()
    elapsed = time.perf_counter() - start
    ray.kill(driver)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, kills, elapsed


def audit(rows: list[dict], expert_ids: list[str], steps: int) -> dict:
    """Steps lost, duplicate updates (a version that rose by more than one in a step, or ended
    above the number of updates applied) and version regressions."""
    out = {"steps lost": steps - len({r["step"] for r in rows}), "duplicate updates": 0, "version regressions": 0}
    for e in expert_ids:
        versions = [0] + [r[f"version/{e}"] for r in rows]
        steps_diff = np.diff(versions)
        out["version regressions"] += int((steps_diff < 0).sum())
        applied = sum(f"loss/{e}" in r for r in rows)
        out["duplicate updates"] += int((steps_diff > 1).sum()) + max(0, versions[-1] - applied)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-every", type=float, default=1.0, help="mean seconds between actor kills")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jointrl-chaos-"))
    os.environ[FAULT_LOG] = str(work / "reward_faults.log")
    Path(os.environ[FAULT_LOG]).touch()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT / 'bench'}:{ROOT}", FAULT_LOG: os.environ[FAULT_LOG]}})
    try:
        print(f"chaos: fault-free run of {args.steps} steps", flush=True)
        clean_rows, _, clean_s = train(config(args.steps, "chaos-clean", False), work / "clean", None, args.seed)
        print(f"chaos: the same run with random faults (a kill every ~{args.kill_every:.1f} s, flaky reward)", flush=True)
        cfg = config(args.steps, "chaos", True)
        rows, kills, chaos_s = train(cfg, work / "chaos", args.kill_every, args.seed)
    finally:
        ray.shutdown()
    last = rows[-1]
    reward_lines = Path(os.environ[FAULT_LOG]).read_text().splitlines()
    injected_reward = len({line.split(" ", 1)[1] for line in reward_lines})  # a retried sample counts once
    restarts = sum(last[f"faults/{k}"] for k in ("expert_restarts", "worker_restarts", "sync_restarts"))
    dropped = sum(r["faults/dropped_samples"] for r in rows)
    reward_faults = sum(r["faults/reward_error"] + r["faults/reward_timeout"] + r["faults/reward_nan"] for r in rows)
    checks = audit(rows, cfg.experts.ids(), args.steps)
    by_kind = {}
    for _, target in kills:
        by_kind[target.split("/")[0]] = by_kind.get(target.split("/")[0], 0) + 1
    print(f"\nfaults injected:   {len(kills) + injected_reward}  (actor kills {len(kills)}: "
          f"{', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))}; reward faults {injected_reward})")
    print(f"faults survived:   {len(kills) + injected_reward if all(v == 0 for v in checks.values()) else 'NOT ALL'}"
          f"  (restarts noticed and restored: {restarts}; reward faults dropped and counted: {reward_faults}, "
          f"samples dropped: {dropped})")
    for name, value in checks.items():
        print(f"{name + ':':18} {value}  (must be 0)")
    print(f"slowdown:          {chaos_s / clean_s:.2f}x  ({chaos_s:.1f} s against {clean_s:.1f} s fault-free, "
          f"{len(clean_rows)} and {len(rows)} steps)")
    return 0 if all(v == 0 for v in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
