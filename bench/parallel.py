"""One expert on two processes against one, side by side in one run (`experts.<id>.parallel`).

update:  the update phase (`time/update_s`, mean over the steps after two warm-ups) of a run whose
         generator update dominates the step (a DiT of width 256 and 4 layers, 16 samples x 6
         steps; the refiners do not train), with the generator on 1 rank and on 2 ranks (ddp,
         fsdp, fsdp keeping gathered blocks from forward to backward, and fsdp keeping them and
         whole gradients through the update's 6 backward passes), each rank one thread;
         this machine has two cores. Bar: 2 ranks <= 0.65x 1 rank.
memory:  bytes each rank holds of the generator's parameters, gradients and optimizer state
         after the run, fsdp on 2 ranks against 1 rank. Bar: <= 0.6x.
Writes bench/results/parallel.md.
Usage: python bench/parallel.py [--steps 6] [--out bench/results/parallel.md]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from cluster.runtime import get  # noqa: E402
from driver.preflight import load_config  # noqa: E402
from driver.launch import start_driver, stop_driver  # noqa: E402

MODEL = ["experts.generator.model.d_model=256", "experts.generator.model.n_layers=4", "experts.generator.sample_steps=6",
         *[f"experts.refiner_{i}.train=false" for i in range(3)], "trainer.prompts_per_step=4", "algorithm.group_size=4"]


RUNS = {"1 rank": [], "2 ranks, ddp": ["ranks=2", "strategy=ddp"], "2 ranks, fsdp": ["ranks=2", "strategy=fsdp"],
        "2 ranks, fsdp, reshard_after_forward=false": ["ranks=2", "strategy=fsdp", "reshard_after_forward=false"],
        "2 ranks, fsdp, defer_gradient_sync=true": ["ranks=2", "strategy=fsdp", "defer_gradient_sync=true"]}


def measure(label: str, steps: int, root: Path) -> dict:
    """(mean update seconds after two warm-up steps, each rank's held bytes) of one run."""
    ranks = 2 if RUNS[label] else 1
    name = f"parallel-{list(RUNS).index(label)}"
    cfg = load_config("shapes-tiny", [*MODEL, f"trainer.steps={steps}", f"trainer.run_name={name}",
                                      *[f"experts.generator.parallel.{kv}" for kv in RUNS[label]]])
    run_dir = root / name
    driver = start_driver(cfg, run_dir)
    try:
        get(driver.run.remote())
        actors = [ray.get_actor(f"{name}/expert/generator" + (f"/rank{r}" if r else ""), namespace="jointrl")
                  for r in range(ranks)]
        held = get([a.state_bytes.remote() for a in actors])
    finally:
        stop_driver(driver)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"update_s": statistics.mean(r["time/update_s"] for r in rows[2:]), "held": held,
            "final_reward": rows[-1]["reward/total"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "parallel.md"))
    args = p.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="jointrl", log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {label: measure(label, args.steps, Path(tmp)) for label in RUNS}
    ray.shutdown()
    one = runs["1 rank"]
    total = lambda held: sum(held.values())  # noqa: E731
    lines = ["# One expert on two processes against one", "",
             f"Generator: tiny DiT width 256, 4 layers, 16 samples x 6 steps per update, refiners frozen; "
             f"{args.steps} steps, update time averaged after 2; each rank one thread, 2 CPU cores, gloo.", "",
             "| generator | update (s) | x 1 rank | held per rank (MiB): params / grads / optimizer | x 1 rank |",
             "|---|---|---|---|---|"]
    for label, r in runs.items():
        held = r["held"][0]
        lines.append(f"| {label} | {r['update_s']:.3f} | "
                     f"{r['update_s'] / one['update_s']:.2f} | "
                     f"{' / '.join(f'{held[k] / 2 ** 20:.2f}' for k in ('params', 'grads', 'optimizer'))} | "
                     f"{max(total(h) for h in r['held']) / total(one['held'][0]):.2f} |")
    ratio = {label: r["update_s"] / one["update_s"] for label, r in runs.items()}
    lines += ["", "- update phase, 2 ranks against 1: " + ", ".join(f"{label[9:]} {ratio[label]:.2f}" for label in
                                                                   list(RUNS)[1:]) + " (bar <= 0.65)",
              "- parameters + gradients + optimizer state per rank between updates, fsdp on 2 ranks against 1: "
              + ", ".join(f"{label[9:]} {max(total(h) for h in r['held']) / total(one['held'][0]):.2f}"
                          for label, r in runs.items() if "fsdp" in label) + " (bar <= 0.6)",
              "- final reward/total (the same run, to float rounding): "
              + ", ".join(f"{r['final_reward']:.6f}" for r in runs.values())]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
