"""PromptRL's claim on `shapes`: joint refiner + generator RL against generator-only Flow-GRPO.

From one pretrained base, with the same rollout budget (steps x prompts x group size) and several
seeds, five methods are trained through the `jointrl` CLI and evaluated with `jointrl eval`:
  generator_only  Flow-GRPO alone, no refiners            (a)
  prompt_only     refiners trained, generator frozen       (b)
  shared          joint, every expert on the total reward  (c)
  per_expert      joint, refiners on the terms they own    (d)
  counterfactual  joint, refiners on D_k = R - R(without y_k)  (e)
The training reward compared is `reward/image`: the detector's partial credit of every training
image against its original prompt, the one term all five methods share. It writes
bench/results/learning.md (rollouts to reach generator-only's final reward, strict accuracy on
held-out and paraphrased prompts, mean +- spread over seeds) and learning.png (reward against
rollouts). Usage: python bench/learning.py [--quick] [--seeds 3] [--steps 60] [--jobs 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from driver.config import load_config  # noqa: E402
from driver.pretrain import pretrain_all  # noqa: E402

METHODS = {
    "generator_only": ["experts.generator_only=true"],
    "prompt_only": ["experts.generator.train=false"],
    "shared": ["algorithm.credit=shared"],
    "per_expert": ["algorithm.credit=per_expert", "experts.generator.owns=[image]"],
    "counterfactual": ["algorithm.credit=counterfactual", "experts.generator.owns=[image]"],
}  # the generator owns the image term where credit is not shared: the text terms are not its doing
# Every method with refiners keeps them nearer their supervised start than SPEC's beta_LM=0.01 does
# (measured: with 0.01 they drift, after ~700 rollouts, to words that cost image reward).
REFINERS = [f"experts.refiner_{i}.kl_beta=0.1" for i in range(3)]
JOINT = ("shared", "per_expert", "counterfactual")
REWARD = "reward/image"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: short pretrain, 2 seeds, few steps")
    p.add_argument("--seeds", type=int, default=None, help="seeds per method (default 3; quick: 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 60; quick: 4)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each uses one thread)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where learning.md/png go")
    p.add_argument("--work", type=Path, default=None, help="where runs go (default: runs/bench-learning[-quick])")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override applied to every method (a method setting, not the benchmark)")
    return p.parse_args()


def settings(args) -> dict:
    quick = args.quick
    return {"seeds": args.seeds or (2 if quick else 3), "steps": args.steps or (4 if quick else 60),
            "base": ["pretrain.steps=150", "pretrain.refiner_steps=30"] if quick else [],
            "run": (["algorithm.group_size=4", "algorithm.num_skip_refinement=1", "trainer.prompts_per_step=2",
                     "experts.generator.sample_steps=4", "evaluation.per_category=4"] if quick else []),
            "work": args.work or ROOT / "runs" / ("bench-learning-quick" if quick else "bench-learning")}


def ensure_base(overrides: list[str]) -> list[str]:
    """The one pretrained base (generator, text encoder, refiners) every method starts from."""
    config = load_config("shapes", ["experts.base=null", *overrides])  # the base made here, not the shipped one
    print(f"bench: base for {config.experts.n_refiners} refiners, {config.pretrain.steps} pretrain steps", flush=True)
    inits, reused = pretrain_all(config, progress=sys.stderr.isatty())
    print(f"bench: {'reusing' if reused else 'trained'} base: {' '.join(inits)}", flush=True)
    return inits


def method_sets(overrides: list[str], method: str, seed: int) -> list[str]:
    return [*overrides, *METHODS[method], f"trainer.seed={seed}", "cluster.mode=inline"]


def run_one(method: str, seed: int, overrides: list[str], work: Path) -> Path:
    """Train with the CLI (inline mode, one thread), then evaluate; a finished run made with the
    same settings is reused."""
    run_dir = work / f"{method}-seed{seed}"
    sets = method_sets(overrides, method, seed)
    if finished(run_dir, sets):
        return run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)  # unfinished, or made with other settings
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = work / f"{method}-seed{seed}.log"
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        train = ["train", "--config", "shapes", "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
        for cmd in (train, ["eval", "--run", str(run_dir)]):
            if subprocess.run([sys.executable, "-m", "driver", *cmd], stdout=out, stderr=subprocess.STDOUT,
                              env=env, cwd=ROOT).returncode:
                raise RuntimeError(f"{method} seed {seed} failed; see {log}")
    (run_dir / "bench_sets.json").write_text(json.dumps(sets))
    print(f"bench: {method} seed {seed} done in {time.perf_counter() - start:.0f} s", flush=True)
    return run_dir


def finished(run_dir: Path, sets: list[str]) -> bool:
    marker = run_dir / "bench_sets.json"
    return marker.is_file() and json.loads(marker.read_text()) == sets


def load(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"rollouts": np.array([r["rollouts"] for r in rows]), "reward": np.array([r[REWARD] for r in rows]),
            "extra": sum(r.get("counterfactual/generations", 0) for r in rows),
            "step_s": float(np.mean([r["time/step_s"] for r in rows])),
            "eval": json.loads((run_dir / "eval.json").read_text())}


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` steps (fewer at the start)."""
    c = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def rollouts_to_reach(run: dict, target: float, window: int) -> float:
    """Rollouts at the first step whose trailing-mean reward reaches `target`; NaN if never."""
    hit = np.nonzero(smooth(run["reward"], window) >= target - 1e-9)[0]
    return float(run["rollouts"][hit[0]]) if len(hit) else float("nan")


def fmt(values, digits=3, missed=0) -> str:
    """mean ± std over seeds, marked as a lower bound (>=) when `missed` seeds never got there."""
    values = np.asarray(values, dtype=float)
    text = f"{values.mean():.{digits}f} ± {values.std():.{digits}f}" if len(values) > 1 else f"{values[0]:.{digits}f}"
    return f">= {text} ({missed}/{len(values)} not reached)" if missed else text


def strict_accuracy(report: dict, name: str) -> float:
    """A set's strict accuracy (mean over the categories) as the method is used: refined where it
    has refiners."""
    by_mode = report["sets"][name]
    return by_mode["refined" if "refined" in by_mode else "unrefined"]["image/strict"]["overall"]


def summarise(runs: dict[str, list[dict]], window: int) -> tuple[float, float, dict]:
    """Target: generator-only's final reward (mean over seeds); its rollouts: the mean over its seeds
    of the rollouts it took to get there. Per method and seed: rollouts to the target and their
    ratio to generator-only's; a seed that never gets there counts as the whole budget (so the
    mean is a lower bound) and is counted as missed."""
    target = float(np.mean([smooth(r["reward"], window)[-1] for r in runs["generator_only"]]))
    budget = float(runs["generator_only"][0]["rollouts"][-1])
    reach = {m: np.array([rollouts_to_reach(r, target, window) for r in seeds]) for m, seeds in runs.items()}
    reference = float(np.nan_to_num(reach["generator_only"], nan=budget).mean())
    out = {}
    for method, seeds in runs.items():
        held = [strict_accuracy(r["eval"], "held_out") for r in seeds]
        para = [strict_accuracy(r["eval"], "paraphrased") for r in seeds]
        capped = np.nan_to_num(reach[method], nan=budget)
        out[method] = {"reach": capped, "missed": int(np.isnan(reach[method]).sum()), "ratio": capped / reference,
                       "final": [smooth(r["reward"], window)[-1] for r in seeds],
                       "held": held, "para": para, "drop": [h - p for h, p in zip(held, para)],
                       "extra": [r["extra"] for r in seeds], "step_s": [r["step_s"] for r in seeds]}
    return target, reference, out


def verdicts(stats: dict) -> list[str]:
    """Each bar of issue 3, checked on the means; a difference smaller than the seeds' spread is
    called what it is."""
    ratio = {m: float(np.mean(stats[m]["ratio"])) for m in stats}
    drop = {m: float(np.mean(stats[m]["drop"])) for m in stats}
    spread = {m: float(np.std(stats[m]["drop"])) for m in stats}
    lines = []
    for m in JOINT:
        ok = ratio[m] <= 0.5 and not stats[m]["missed"]
        lines.append(f"- {m} reaches generator-only's final reward with {ratio[m]:.2f}x its rollouts "
                     f"(bar: <= 0.5x; moonshot 0.33x): {'met' if ok else 'missed'}")
    for m in JOINT:
        gap = drop["generator_only"] - drop[m]
        noise = max(spread[m], spread["generator_only"])
        verdict = ("met" if gap > noise else "missed") if abs(gap) > noise else "no difference beyond the seeds' spread"
        lines.append(f"- {m}: held-out -> paraphrased drop {drop[m]:+.3f} against generator-only's "
                     f"{drop['generator_only']:+.3f} (spread {noise:.3f}): {verdict}")
    lines.append(f"- counterfactual ({ratio['counterfactual']:.2f}x) at least as fast as per_expert "
                 f"({ratio['per_expert']:.2f}x): {'met' if ratio['counterfactual'] <= ratio['per_expert'] else 'missed'}")
    lines.append(f"- per_expert and counterfactual both faster than shared ({ratio['shared']:.2f}x): "
                 f"{'met' if max(ratio['per_expert'], ratio['counterfactual']) < ratio['shared'] else 'missed'}")
    return lines


def write_report(path: Path, target: float, reference: float, stats: dict, info: dict) -> None:
    lines = [f"# Learning benchmark: joint RL against generator-only Flow-GRPO{' (quick smoke run)' if info['quick'] else ''}",
             "", f"Written by `python bench/learning.py{' --quick' if info['quick'] else ''}` on {info['date']} "
             f"in {info['minutes']:.1f} min ({info['reused']} of {info['runs']} runs reused from an earlier "
             f"invocation). {info['seeds']} seeds per method, {info['steps']} steps of "
             f"{info['per_step']} rollouts each ({info['steps'] * info['per_step']} per run), all from the "
             f"base `{info['base']}`.", "",
             f"Training reward: `{REWARD}` (every training image against its original prompt), trailing mean "
             f"over {info['window']} steps. Target: generator-only's final value, **{target:.3f}** (mean over "
             f"seeds), which generator-only itself first reaches after **{reference:.0f}** rollouts (mean over "
             "seeds): the × column divides by that. Strict accuracy: `jointrl eval` on the fixed held-out set and its paraphrases, "
             "mean over the six categories. Values are mean ± standard deviation over seeds.", "",
             "| method | rollouts to target | × generator-only | final reward | strict held-out | "
             "strict paraphrased | drop | extra generations | s/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, s in stats.items():
        lines.append(f"| {m} | {fmt(s['reach'], 0, s['missed'])} | {fmt(s['ratio'], 2, s['missed'])} | {fmt(s['final'])} | {fmt(s['held'])} | "
                     f"{fmt(s['para'])} | {fmt(s['drop'])} | {fmt(s['extra'], 0)} | {fmt(s['step_s'], 2)} |")
    lines += ["", "Extra generations are the counterfactual regenerations (same noise, one refinement "
              "dropped); they are not counted in the rollout budget.", "", "## Bars (issue 3)", "",
              *verdicts(stats), "", "## Methods", "",
              *[f"- {m}: `{' '.join(sets)}`" for m, sets in METHODS.items()],
              f"- every method with refiners: `{' '.join(REFINERS)}`", "",
              f"Overrides on every method: `{' '.join(info['overrides']) or 'none'}`.", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, runs: dict[str, list[dict]], target: float, window: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for method, seeds in runs.items():
        x = seeds[0]["rollouts"]
        curves = np.stack([smooth(r["reward"], window) for r in seeds])
        line, = ax.plot(x, curves.mean(0), label=method)
        ax.fill_between(x, curves.min(0), curves.max(0), color=line.get_color(), alpha=0.15)
    ax.axhline(target, color="grey", ls="--", lw=1, label="generator-only final")
    ax.set_xlabel("rollouts (training images)")
    ax.set_ylabel(f"{REWARD} (trailing mean of {window} steps)")
    ax.set_title("shapes: joint RL vs generator-only (band: min-max over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    s = settings(args)
    start = time.perf_counter()
    base = ["experts.base=null", *ensure_base(s["base"] + args.overrides)]
    overrides = [*s["base"], *base, *s["run"], *REFINERS, f"trainer.steps={s['steps']}", *args.overrides]
    jobs = [(m, seed) for seed in range(s["seeds"]) for m in METHODS]
    reused = sum(finished(s["work"] / f"{m}-seed{seed}", method_sets(overrides, m, seed)) for m, seed in jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda job: run_one(*job, overrides, s["work"]), jobs))
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for (m, _), d in zip(jobs, dirs):
        runs[m].append(load(d))
    window = max(1, min(10, s["steps"] // 3))
    target, reference, stats = summarise(runs, window)
    config = load_config("shapes", overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    info = {"quick": args.quick, "runs": len(jobs), "reused": reused, "date": time.strftime("%Y-%m-%d"), "minutes": (time.perf_counter() - start) / 60,
            "seeds": s["seeds"], "steps": s["steps"], "window": window, "overrides": args.overrides,
            "per_step": config.trainer.prompts_per_step * config.algorithm.group_size,
            "base": Path(config.experts.generator.init).parent.name}
    write_report(args.out / "learning.md", target, reference, stats, info)
    plot(args.out / "learning.png", runs, target, window)
    print((args.out / "learning.md").read_text())
    print(f"bench: wrote {args.out / 'learning.md'} and {args.out / 'learning.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
