"""Bytes through the object store per step, and peak host memory of the driver and the expert ranks,
with the optimizer state snapshotted after every update or every N-th.

A widened tiny full fine-tune: the shapes world's generator at `--d-model` x `--layers` (fp32),
trained on two fsdp ranks beside the tiny refiners, on a local Ray of this machine, in each layout
(`--layouts`: separate, with one rollout worker the versions are published to; colocated, where
the generator's ranks roll out and nothing is published). Each setting of
`cluster.optimizer_snapshot_every` runs `--steps` steps in a fresh process. Reported per run:
- the bytes Ray created in its object store over the run (its raylet's `cumulative_created_bytes`:
  every put and every returned object, snapshots and rollouts alike), in all and per step;
- the peak resident memory (VmHWM) of the driver actor's process and of the largest expert rank's,
  read every 0.2 s while they run;
- the run's final metrics, which must not differ between the settings (the snapshot cadence changes
  what is kept, not what is computed).

    python bench/store_traffic.py [--d-model 384] [--layers 4] [--steps 8] [--every 1 4]
                                  [--layouts separate colocated] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 2 ** 20

MEASURE = r"""
import json, os, sys, tempfile, threading, time
from pathlib import Path
import ray
from ray._private.internal_api import get_memory_info_reply, get_state_from_address
import driver.cli as cli

overrides = json.loads(sys.argv[1])
ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="jointrl", _node_ip_address="127.0.0.1")


def created() -> int:
    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return reply.store_stats.cumulative_created_bytes


def peak_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


peaks, done = {}, False


def watch():
    while not done:
        for proc in Path("/proc").iterdir():
            try:
                title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode()
                role = "driver" if title.startswith("ray::DriverActor") else \
                    "expert" if title.startswith("ray::ExpertActor") else None
                if role:
                    peaks[(role, proc.name)] = max(peaks.get((role, proc.name), 0), peak_of(int(proc.name)))
            except (OSError, ValueError):
                pass
        time.sleep(0.2)


watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
before = created()
with tempfile.TemporaryDirectory() as tmp:
    code = cli.main(["train", "--config", "shapes-tiny", *[a for o in overrides for a in ("--set", o)],
                     "--run-dir", str(Path(tmp) / "run")])
    rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
after = created()
done = True
watcher.join()
last = {k: v for k, v in rows[-1].items() if k.startswith(("loss/", "reward/", "version/", "grad_norm/"))}
print(json.dumps({"code": code, "created": after - before, "steps": len(rows), "last": last,
                  "driver": max((b for (r, _), b in peaks.items() if r == "driver"), default=0),
                  "expert": max((b for (r, _), b in peaks.items() if r == "expert"), default=0)}))
"""


def measure(overrides: list[str]) -> dict:
    """One run in a fresh process (its own Ray) with `overrides` on shapes-tiny."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(overrides)], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"bench: the run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=384, help="the generator's width")
    p.add_argument("--layers", type=int, default=4, help="the generator's transformer blocks")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, nargs="+", default=[1, 4], help="cluster.optimizer_snapshot_every values")
    p.add_argument("--layouts", nargs="+", choices=["separate", "colocated"], default=["separate", "colocated"])
    p.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = p.parse_args()
    base = [f"trainer.steps={args.steps}", "trainer.checkpoint_every_s=0", "cluster.mode=ray",
            f"experts.generator.model.d_model={args.d_model}", f"experts.generator.model.n_layers={args.layers}",
            "experts.generator.parallel.ranks=2", "experts.generator.parallel.strategy=fsdp"]
    lines = [f"`python bench/store_traffic.py --d-model {args.d_model} --layers {args.layers} --steps {args.steps} "
             f"--every {' '.join(map(str, args.every))} --layouts {' '.join(args.layouts)}` (shapes-tiny, the "
             f"generator widened to {args.d_model} x {args.layers} blocks, 2 fsdp ranks, a local Ray of 2 CPUs)", "",
             "| layout | optimizer_snapshot_every | store bytes, all (MB) | per step (MB) | driver peak RSS (MB) | "
             "largest expert rank peak RSS (MB) |", "|---|---|---|---|---|---|"]
    same = True
    for layout in args.layouts:
        finals = {}
        for every in args.every:
            r = measure([*base, f"cluster.layout={layout}", f"cluster.optimizer_snapshot_every={every}"])
            if r["code"] != 0 or r["steps"] != args.steps:
                sys.exit(f"bench: {layout}, optimizer_snapshot_every={every}: exit {r['code']}, {r['steps']} steps")
            finals[every] = r["last"]
            lines.append(f"| {layout} | {every} | {r['created'] / MB:.0f} | {r['created'] / MB / args.steps:.1f} | "
                         f"{r['driver'] / MB:.0f} | {r['expert'] / MB:.0f} |")
            print(lines[-1], flush=True)
        same &= all(f == finals[args.every[0]] for f in finals.values())
    lines += ["", f"Final metrics (losses, rewards, versions, gradient norms) equal across the settings of each "
                  f"layout: {same}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
