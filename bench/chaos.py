"""Chaos: a run of K steps on local Ray with random faults of every kind at random moments.

Faults: an expert, a rollout worker or the weight-sync actor killed (`ray.kill`, restart allowed),
a reward that raises, returns NaN or hangs past its deadline (`reward.timeout_s`) on some samples,
and with `--node-every` the loss of the node hosting a random expert or rollout worker (three simulated
nodes, `ray.cluster_utils.Cluster`; a fresh node joins after each loss, as an autoscaler's would).
It prints the faults injected and survived, steps lost, duplicate updates and version regressions
(each must be 0), and the slowdown against a fault-free run of the same config on the same cluster.
Usage: python bench/chaos.py [--steps 40] [--kill-every 2.0] [--node-every S] [--seed 0]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from cluster.runtime import get  # noqa: E402
from driver.preflight import load_config  # noqa: E402
from driver.launch import start_driver, stop_driver  # noqa: E402
from tasks.rewards.base import Options  # noqa: E402
from tasks.rewards.shapes import ShapesImage  # noqa: E402

FAULT_LOG = "JOINTRL_CHAOS_LOG"
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                      "health_check_failure_threshold": 3, "health_check_timeout_ms": 500}
POOL = {"pool": 10}  # what the simulated worker nodes offer; every actor but the driver needs a share


def flaky_reward(images, prompts, refinements):
    """The shapes image term, except for ~3% of samples (chosen by a hash of the image, so a retried
    sample fails the same way): it raises, returns NaN, or hangs past the timeout."""
    values = ShapesImage(Options(), None)(images, prompts, refinements)
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
        values[i] = np.nan
    return values


def config(steps: int, run_name: str, chaos: bool, nodes: bool):
    sets = [f"trainer.steps={steps}", "cluster.rollout_workers=2", "cluster.max_restarts=1000"]
    if nodes:
        share = "resources.custom={pool: 0.01}"
        sets += [f"cluster.rollout_{share}"] + [f"experts.{e}.{share}" for e in
                                               ("refiner_0", "refiner_1", "refiner_2", "generator")]
    if chaos:
        sets += ["reward.terms.image.fn=chaos:flaky_reward", "reward.timeout_s=0.5", "reward.timeout_per_image_s=0"]
    cfg = load_config("shapes-tiny", sets)
    cfg.trainer.run_name = run_name
    return cfg


def kill(run_name: str, target: str) -> bool:
    """Kill one actor of the run, restart allowed; False if it is not registered right now."""
    try:
        ray.kill(ray.get_actor(f"{run_name}/{target}", namespace="jointrl"), no_restart=False)
        return True
    except ValueError:
        return False


def lose_node(run_name: str, target: str, cluster, pool_nodes: list) -> bool:
    """Remove the node hosting `target` (an expert or rollout worker), then add a fresh one."""
    try:
        node_id = ray.get(ray.get_actor(f"{run_name}/{target}", namespace="jointrl").node.remote(), timeout=5)
    except (ValueError, ray.exceptions.RayError):  # restarting right now: nothing was removed
        return False
    node = next((n for n in pool_nodes if n.node_id == node_id), None)
    if node is None:
        return False
    cluster.remove_node(node, allow_graceful=False)
    pool_nodes.remove(node)
    pool_nodes.append(cluster.add_node(num_cpus=1, resources=POOL))
    return True


def train(cfg, run_dir: Path, kill_every: float | None, seed: int, nodes=None,
          node_every: float | None = None) -> tuple[list[dict], list, float]:
    """The run, with an actor killed every ~`kill_every` s and, given `nodes` (the cluster and its
    pool nodes), a node lost every ~`node_every` s, at exponentially spaced moments from the start
    (the driver's own start included). Faults are injected from this thread: Ray starts nodes only
    from the main thread. Returns (metric rows, (time, fault) log, seconds)."""
    hosted = [f"expert/{e}" for e in cfg.experts.ids()] + ["rollout/0", "rollout/1"]
    rng, name = random.Random(seed), cfg.trainer.run_name
    start = time.perf_counter()
    driver = start_driver(cfg, run_dir)
    done, log = driver.run.remote(), []
    faults = {"kill": kill_every, "node": node_every if nodes else None}
    due = {kind: start + rng.expovariate(1 / every) for kind, every in faults.items() if every}
    while not ray.wait([done], timeout=max(0.0, min(due.values(), default=start + 1e9) - time.perf_counter()))[0]:
        kind = min(due, key=due.get)
        if time.perf_counter() < due[kind]:
            continue
        if kind == "kill":
            target = rng.choice(hosted + ["weight_sync"])
            if kill(name, target):
                log.append((time.perf_counter(), target))
        else:
            target = rng.choice(hosted)
            if lose_node(name, target, *nodes):
                log.append((time.perf_counter(), f"node/{target}"))
        due[kind] = time.perf_counter() + rng.expovariate(1 / faults[kind])
    get(done)
    elapsed = time.perf_counter() - start
    stop_driver(driver)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, log, elapsed


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
    p.add_argument("--kill-every", type=float, default=2.0, help="mean seconds between actor kills")
    p.add_argument("--node-every", type=float, default=None,
                   help="mean seconds between node losses (runs on three simulated nodes; default: no node loss)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jointrl-chaos-"))
    os.environ[FAULT_LOG] = str(work / "reward_faults.log")
    Path(os.environ[FAULT_LOG]).touch()
    runtime_env = {"env_vars": {"PYTHONPATH": f"{ROOT / 'bench'}:{ROOT}", FAULT_LOG: os.environ[FAULT_LOG]}}
    nodes, cluster = None, None
    if args.node_every:
        from ray.cluster_utils import Cluster
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "_system_config": FAST_HEALTH_CHECKS})
        nodes = (cluster, [cluster.add_node(num_cpus=1, resources=POOL) for _ in range(2)])
        ray.init(address=cluster.address, namespace="jointrl", runtime_env=runtime_env)
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env=runtime_env)
    try:
        print(f"chaos: fault-free run of {args.steps} steps", flush=True)
        clean_rows, _, clean_s = train(config(args.steps, "chaos-clean", False, bool(nodes)), work / "clean", None,
                                       args.seed)
        print(f"chaos: the same run with random faults (a kill every ~{args.kill_every:.1f} s, flaky reward"
              + (f", a node lost every ~{args.node_every:.1f} s)" if nodes else ")"), flush=True)
        cfg = config(args.steps, "chaos", True, bool(nodes))
        rows, kills, chaos_s = train(cfg, work / "chaos", args.kill_every, args.seed, nodes, args.node_every)
    finally:
        ray.shutdown()
        if cluster:
            cluster.shutdown()
    last = rows[-1]
    reward_lines = Path(os.environ[FAULT_LOG]).read_text().splitlines()
    injected_reward = len({line.split(" ", 1)[1] for line in reward_lines})  # a retried sample counts once
    restarts = sum(last[f"faults/{k}"] for k in ("expert_restarts", "worker_restarts", "sync_restarts"))
    rollouts_lost = last["faults/rollouts_lost"]
    dropped = sum(r["faults/dropped_samples"] for r in rows)
    reward_faults = sum(r["faults/reward_error"] + r["faults/reward_timeout"] + r["faults/reward_nan"] for r in rows)
    checks = audit(rows, cfg.experts.ids(), args.steps)
    by_kind = {}
    for _, target in kills:
        by_kind[target.split("/")[0]] = by_kind.get(target.split("/")[0], 0) + 1
    lost_nodes = by_kind.pop("node", 0)
    print(f"\nfaults injected:   {len(kills) + injected_reward}  (actor kills {len(kills) - lost_nodes}: "
          f"{', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))}; node losses {lost_nodes}; "
          f"reward faults {injected_reward})")
    print(f"faults survived:   {len(kills) + injected_reward if all(v == 0 for v in checks.values()) else 'NOT ALL'}"
          f"  (restarts noticed and restored: {restarts}; rollouts made again: {rollouts_lost}; reward faults dropped and counted: {reward_faults}, "
          f"samples dropped: {dropped})")
    for name, value in checks.items():
        print(f"{name + ':':18} {value}  (must be 0)")
    print(f"slowdown:          {chaos_s / clean_s:.2f}x  ({chaos_s:.1f} s against {clean_s:.1f} s fault-free, "
          f"{len(clean_rows)} and {len(rows)} steps)")
    return 0 if all(v == 0 for v in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
