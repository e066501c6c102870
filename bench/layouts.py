"""The colocated layout against the separate one on two CPU processes as two devices (`cluster.layout`).

separate:  the generator on 1 rank and 1 rollout worker: the worker rolls out every sample, the
           expert updates on all of them, and each new version is synced to the worker.
colocated: the generator on 2 ddp ranks and no worker: each rank rolls out half the samples with
           the weights it trains, then both update on their halves (gradients all-reduced).
The same samples per step (generator-only Flow-GRPO, 16 samples of 12 steps, a tiny DiT of width
256 and 4 layers, SDE and training on steps 0-1, so that the rollout and the update take about as
long), each process one thread. Measured: the synchronous step time (`time/step_s`, median over
the steps after two warm-ups), its rollout and update phases, and each model process's peak
resident memory, each layout run `--repeats` times in turn and its fastest run shown; beside each,
the planner's estimate for the same config (driver/commands/layout_plan.py: per-sample costs measured
in-process on this CPU, memory from the plan). Bar: colocated <= 0.6x separate.
Writes bench/results/layouts.md.
Usage: python bench/layouts.py [--steps 8] [--repeats 2] [--out bench/results/layouts.md]
"""
from __future__ import annotations

import argparse
import json
import resource
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
from driver.commands.layout_plan import compare, measured_costs  # noqa: E402
from driver.plan import Target  # noqa: E402

MODEL = ["experts.generator_only=true", "experts.generator.model.d_model=256", "experts.generator.model.n_layers=4",
         "experts.generator.sample_steps=12", "experts.generator.sde_window=[0, 2]", "experts.generator.kl_beta=0.05",
         "trainer.prompts_per_step=4", "algorithm.group_size=4", "rollout.text_cache_mb=8"]
LAYOUTS = {"separate": ["cluster.layout=separate", "cluster.rollout_workers=1"],
           "colocated": ["cluster.layout=colocated", "experts.generator.parallel.ranks=2",
                         "experts.generator.parallel.strategy=ddp"]}
PROCESSES = {"separate": ["expert/generator", "rollout/0"], "colocated": ["expert/generator", "expert/generator/rank1"]}


def peak_rss(self) -> int:
    """This process's peak resident memory in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Spinner:
    """A one-thread process that computes for a fixed amount of work: two of them at once against one
    alone says how much of two cores the machine gives this benchmark right now."""

    def __init__(self):
        import torch
        torch.set_num_threads(1)

    def spin(self, n: int) -> float:
        import time

        import torch
        a, start = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)), time.perf_counter()
        for _ in range(n):
            a = torch.tanh(a @ a * 0.01)
        return time.perf_counter() - start


def two_at_once(n: int = 3000) -> float:
    """Seconds of two processes computing `n` steps at once over one doing it alone (1.0 on two free
    cores, 2.0 where only one core is free)."""
    import time
    spinners = [ray.remote(num_cpus=0)(Spinner).remote() for _ in range(2)]
    ray.get([s.spin.remote(10) for s in spinners])
    start = time.perf_counter()
    ray.get(spinners[0].spin.remote(n))
    alone = time.perf_counter() - start
    start = time.perf_counter()
    ray.get([s.spin.remote(n) for s in spinners])
    both = time.perf_counter() - start
    for s in spinners:
        ray.kill(s)
    return both / alone


def config_of(layout: str, steps: int, name: str):
    return load_config("shapes-tiny", [*MODEL, *LAYOUTS[layout], f"trainer.steps={steps}", f"trainer.run_name={name}"])


def measure(layout: str, steps: int, root: Path, repeat: int) -> dict:
    """One run of `layout`: its metric rows and each model process's peak resident memory."""
    name = f"layouts-{layout}-{repeat}"
    driver = start_driver(config_of(layout, steps, name), root / name)
    try:
        get(driver.run.remote())
        peaks = {p: ray.get(ray.get_actor(f"{name}/{p}", namespace="jointrl").__ray_call__.remote(peak_rss))
                 for p in PROCESSES[layout]}
    finally:
        stop_driver(driver)
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows[2:], "peaks": peaks}


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="runs of each layout, taken in turn")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "layouts.md"))
    args = p.parse_args()
    costs = measured_costs(config_of("separate", args.steps, "plan"))
    here = Target(1, 0, 0.0, 0.0, "this machine")
    planned = {layout: compare(config_of(layout, args.steps, "plan"), here, costs)[layout] for layout in LAYOUTS}
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="jointrl", log_to_driver=False)
    cores = [two_at_once()]
    tries: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # the layouts taken in turn, so that both see the machine's moods
            for layout in LAYOUTS:
                tries[layout].append(measure(layout, args.steps, Path(tmp), repeat))
            cores.append(two_at_once())
    ray.shutdown()
    every = {layout: [median(r["rows"], "time/step_s") for r in runs] for layout, runs in tries.items()}
    runs = {layout: min(runs, key=lambda r: median(r["rows"], "time/step_s")) for layout, runs in tries.items()}
    step = {layout: median(r["rows"], "time/step_s") for layout, r in runs.items()}
    ratio, planned_ratio = step["colocated"] / step["separate"], \
        planned["colocated"].step_s / planned["separate"].step_s
    lines = ["# Colocated against separate on two CPU processes", "",
             "Generator-only Flow-GRPO: tiny DiT width 256, 4 layers, 16 samples x 12 steps, SDE and training on "
             f"steps 0-1, kl_beta 0.05; {args.steps} steps, medians after 2 warm-ups; each process one thread, gloo. "
             "separate: 1 expert rank + 1 rollout worker; colocated: 2 ddp ranks of the generator, no worker. "
             "Planner: driver/commands/layout_plan.py with the per-sample costs it measured in-process before the runs "
             f"(rollout {costs.generate * 1e3:.1f} ms, update {costs.update['generator'] * 1e3:.1f} ms a sample).", "",
             "How much of two cores there was to have (with less than two free, the colocated ranks cannot overlap "
             "and the ratio says so): two one-thread processes computing at once took "
             + ", ".join(f"{c:.2f}" for c in cores) + "x the time of one alone (before the runs, then after each "
             "round; 1.0 on two free cores, 2.0 with one), so the colocated layout's two ranks could go at most "
             f"{2 / max(cores):.2f}-{2 / min(cores):.2f}x as fast as one process.", "",
             "| layout | step (s) | planned | rollout (s) | planned | update (s) | planned | sync (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for layout, r in runs.items():
        e = planned[layout]
        lines.append(f"| {layout} | {step[layout]:.3f} | {e.step_s:.3f} | {median(r['rows'], 'time/rollout_s'):.3f} | "
                     f"{e.rollout_s:.3f} | {median(r['rows'], 'time/update_s'):.3f} | {e.update_s:.3f} | "
                     f"{median(r['rows'], 'time/sync_s'):.3f} |")
    lines += ["", f"- step time, colocated against separate: **{ratio:.2f}x** measured (bar <= 0.6), "
                  f"{planned_ratio:.2f}x planned",
              f"- each run's median step (s), in the order run, the layouts in turn; the table shows each layout's "
              f"fastest: " + "; ".join(f"{layout} " + ", ".join(f"{x:.3f}" for x in xs) for layout, xs in every.items()),
              "",
              "| layout | process | peak resident memory (MiB) | planned model and data bytes (MiB) |",
              "|---|---|---|---|"]
    for layout, r in runs.items():
        for process, peak in r["peaks"].items():
            lines.append(f"| {layout} | {process} | {peak / 2 ** 20:.0f} | "
                         f"{planned[layout].bytes[process] / 2 ** 20:.1f} |")
    lines += ["", "The resident figure includes the interpreter, torch and Ray's worker (about 180 MB a process, "
                  "/work/shared/RAY_NOTES.md); the plan counts what the process holds for its models and data.",
              "- final reward/total of each run (the same numbers to float rounding): "
              + ", ".join(f"{layout} {r['rows'][-1]['reward/total']:.6f}" for layout, r in runs.items())]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
