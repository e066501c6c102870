"""PromptRL's claim on `shapes`, measured the way PromptRL trains: joint refiner + generator RL
against generator-only Flow-GRPO, by strict accuracy on held-out prompts against rollouts.

From the pretrained base the `shapes` preset ships (configs/bases/shapes), with the same rollout
budget (steps x prompts x group size) and several seeds, each method is trained through the
`jointrl` CLI (inline, one thread) with the held-out set and its paraphrases evaluated every few
steps (`evaluation.every`). Methods:

  the headline: PromptRL (arXiv 2602.01382) against Flow-GRPO (arXiv 2505.05470) alone
    generator_only           Flow-GRPO alone, no refiners
    prompt_only              refiners trained on image + a small format term; generator frozen
    promptrl_shared          joint, every expert on image + a small format term (PromptRL)
    promptrl_counterfactual  joint, refiners on D_k = R - R(without y_k) of that same total
    promptrl_replace         promptrl_shared with the generator reading the refinements in place of
                             the prompt (task.compose=replace), as PromptRL's code trains
  the N-way credit-assignment study on text terms (refiners paid for fidelity, style, format)
    shared                   every expert on the total
    per_expert               refiners on the terms they own, the generator on the image term
    counterfactual           refiners on D_k of the total, the generator on the image term

Groups are PromptRL's: 6 refined and 2 original samples per prompt (`algorithm.group_size` 8,
`num_skip_refinement` 2, the preset's). The primary measure is strict accuracy (GenEval's: every
object, count, colour and relation right) on the held-out set, as each method is used (refined
where it has refiners), mean over the six categories. The headline: rollouts a method takes to
reach generator-only's final strict accuracy, against generator-only's own. The refiners' own
lever: the frozen base generator drawing from the trained refiners' prompts against drawing from
the base refiners' (and from the original prompt).

The benchmark's settings (BENCH) were fixed from generator-only's curve alone, before any joint
method was compared; bench/results/learning_settings.notes.md says why each is what it is. Usage:
  python bench/learning.py [--quick] [--seeds 5] [--methods generator_only ...] [--jobs 2] [--name NAME]
Tuning a method (bench/results/learning_tuning.notes.md): `--tune KEY=VALUE` changes the methods run
but not generator-only, the reference, whose runs are reused; tuned runs have their own folders.
A finished run is reused only if it was made with the same overrides by the same code and from the
same base (code_digest: the files of CODE and every file a run starts from); else it is run again.
The script writes NAME.md and NAME.png (default `learning`) and nothing else in --out.
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
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from driver.preflight import load_config  # noqa: E402

PROMPTRL_REWARD = ["reward.terms.fidelity.weight=0", "reward.terms.style.weight=0", "reward.terms.format.weight=0.1"]
METHODS = {
    "generator_only": ["experts.generator_only=true"],
    "prompt_only": [*PROMPTRL_REWARD, "algorithm.credit=shared", "experts.generator.train=false"],
    "promptrl_shared": [*PROMPTRL_REWARD, "algorithm.credit=shared"],
    "promptrl_counterfactual": [*PROMPTRL_REWARD, "algorithm.credit=counterfactual", "experts.generator.owns=[image]"],
    "promptrl_replace": [*PROMPTRL_REWARD, "algorithm.credit=shared", "task.compose=replace"],
    # PromptRL's single rewriter: one LM whose supervised start restates the whole request in its
    # usual words (pretrain.rewrite_share, shipped beside each base), read in place of the prompt;
    # the format term (2 to 5 words) would pay it to cut the request short, so it weighs nothing.
    # Its lr is a tenth of its supervised start's, as PromptRL trains its LM far below SFT rates: at
    # the refiners' 3e-3 it unlearnt copying within 30 steps (settings.notes.md, rare_wording seed 0)
    "promptrl_rewrite": [*PROMPTRL_REWARD, "reward.terms.format.weight=0", "algorithm.credit=shared",
                         "task.compose=replace", "experts.n_refiners=1", "experts.refiner_0.max_new_tokens=17",
                         "pretrain.rewrite_share=1.0", "experts.refiner_0.lr=3e-4"],
    # the rewriter (refiner_0, as above) beside two detail refiners, each paid by its counterfactual
    # D_k: the rewriter says the request in the words the generator reads, the detail refiners vary
    # each sample's details; the generator reads the rewrite and the details in place of the prompt
    "promptrl_rewrite_detail": [*PROMPTRL_REWARD, "reward.terms.format.weight=0", "algorithm.credit=counterfactual",
                                "experts.generator.owns=[image]", "task.compose=replace",
                                "experts.refiner_0.max_new_tokens=17", "pretrain.rewrite_shares={refiner_0: 1.0}",
                                "experts.refiner_0.lr=3e-4"],
    "shared": ["algorithm.credit=shared"],
    "per_expert": ["algorithm.credit=per_expert", "experts.generator.owns=[image]"],
    "counterfactual": ["algorithm.credit=counterfactual", "experts.generator.owns=[image]"],
}  # the generator owns the image term where credit is not shared: the other terms are not its doing
HEADLINE = ("promptrl_shared", "promptrl_counterfactual", "promptrl_replace")
TEXT_STUDY = ("counterfactual", "per_expert", "shared")
TRANSFER = ("prompt_only", "promptrl_shared", "promptrl_counterfactual")  # refiners paid by the image term
# Every method with refiners keeps them nearer their supervised start than beta_LM=0.01 does
# (measured: with 0.01 they drift, after ~700 rollouts, to words that cost image reward).
REFINERS = ["experts.refiner_defaults.kl_beta=0.1"]
# Fixed from generator-only's curve (bench/results/learning_settings.notes.md), not from any joint method.
BENCH = ["evaluation.every=10", "evaluation.per_category=100", "evaluation.batch_size=50",
         "trainer.prompts_per_step=8", "trainer.steps=150"]
QUICK = ["evaluation.every=2", "evaluation.per_category=3", "trainer.prompts_per_step=2", "trainer.steps=4",
         "algorithm.group_size=4", "algorithm.num_skip_refinement=1", "experts.generator.sample_steps=4"]
STRICT = "image/strict"
FINAL_EVALS = 3  # "final" accuracy: the mean of the last three evaluations
SMOOTH = 2       # a curve reaches a target when the mean of two consecutive evaluations does
# Generator-only's final accuracy lies on its plateau, where the first crossing is decided by a
# 0.01 wobble (the x of generator-only's own seeds spreads by 0.40); 80% of its gain from the base
# is reached on the rise, where its seeds spread by 0.22. Both are reported; the first is the bar.
GAIN = 0.8
# The code that makes a run's numbers: a finished run is reused only if these folders' files and the
# base's are what they were when it was made.
CODE = ("algorithm", "experts", "tasks", "common")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: a few steps and prompts")
    p.add_argument("--seeds", type=int, default=None, help="seeds per method (default 5; quick: 1)")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                   help="the methods to run (generator_only is always run: it is the reference)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each uses one thread)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the report and plot go")
    p.add_argument("--name", default="learning", help="the report's and plot's file name, NAME.md and NAME.png")
    p.add_argument("--work", type=Path, default=None, help="where runs go (default: runs/bench-learning[-quick])")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override applied to every method (a method setting, not the benchmark)")
    p.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of the methods run, not of generator-only (the reference, reused)")
    p.add_argument("--transfer-study", action="store_true",
                   help="also evaluate generator-only's trained generator with each run's trained refiners")
    p.add_argument("--lever", type=Path, default=None, help=argparse.SUPPRESS)  # one run's lever (a subprocess)
    p.add_argument("--transfer", type=Path, nargs="+", default=None, help=argparse.SUPPRESS)  # one seed's transfer
    args = p.parse_args()
    if args.tune and args.transfer_study:
        p.error("--transfer-study measures the benchmark's runs, not tuned ones: run it without --tune")
    return args


def method_sets(overrides: list[str], method: str, seed: int, tune: list[str]) -> list[str]:
    """A run's overrides: the benchmark's, the method's, then `tune` (not for generator-only)."""
    if method == "generator_only":
        return [*overrides, *METHODS[method], f"trainer.seed={seed}", "cluster.mode=inline"]
    return [*overrides, *REFINERS, *METHODS[method], *tune, f"trainer.seed={seed}", "cluster.mode=inline"]


def run_path(work: Path, method: str, seed: int, tune: list[str]) -> Path:
    """A run's folder: a tuned method's carries a hash of its `tune` (its bench_sets.json lists them)."""
    tag = f"+{hashlib.sha256(json.dumps(tune).encode()).hexdigest()[:8]}" if tune and method != "generator_only" else ""
    return work / f"{method}{tag}-seed{seed}"


def code_digest(config) -> str:
    """sha256 of the files under CODE and of the files the runs start from (every expert's `init`,
    the text encoder's: the base), by path and content."""
    code = sorted(p for d in CODE for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    inits = {s.init for s in [*config.experts.sections().values(), config.experts.text_encoder] if s.init}
    digest = hashlib.sha256()
    for path, name in [*((p, p.relative_to(ROOT)) for p in code), *((Path(f), Path(f).name) for f in sorted(inits))]:
        data = path.read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:16]


def run_one(method: str, seed: int, overrides: list[str], tune: list[str], work: Path, code: str) -> Path:
    """Train with the CLI (inline, one thread; the evaluations are in its metrics), then measure the
    refiners' lever in a subprocess; a finished run made with the same settings by the same code
    (`code`, code_digest) is reused."""
    run_dir = run_path(work, method, seed, tune)
    sets = method_sets(overrides, method, seed, tune)
    if finished(run_dir, sets, code):
        return run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)  # unfinished, or made with other settings or code
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = run_dir.with_name(run_dir.name + ".log")
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train = [sys.executable, "-m", "driver", "train", "--config", "shapes", "--run-dir", str(run_dir),
             *[a for s in sets for a in ("--set", s)]]
    lever = [sys.executable, str(Path(__file__).resolve()), "--lever", str(run_dir)]
    with open(log, "w") as out:
        for cmd in (train, lever):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode:
                raise RuntimeError(f"{method} seed {seed} failed; see {log}")
    (run_dir / "bench_sets.json").write_text(json.dumps({"sets": sets, "code": code}))
    print(f"bench: {method} seed {seed} done in {time.perf_counter() - start:.0f} s", flush=True)
    return run_dir


def finished(run_dir: Path, sets: list[str], code: str) -> bool:
    """Whether `run_dir` holds a whole run made with `sets` by the code and base `code` names."""
    marker = run_dir / "bench_sets.json"
    return marker.is_file() and json.loads(marker.read_text()) == {"sets": sets, "code": code}


def measure_lever(run_dir: Path) -> None:
    """lever.json: strict accuracy of the frozen base generator on the run's evaluation sets, drawn
    from the original prompts, from the base refiners' refinements and (where the run trained its
    refiners) from the trained refiners'. The base is also the curves' first point (0 rollouts)."""
    import torch

    from driver.checkpoint import latest_weights
    from driver.preflight import run_config
    from experts.devices import local_device
    from experts.pipeline import RolloutPipeline
    from experts.weights import model_tensors
    from tasks.evaluation import evaluate_sets
    torch.set_num_threads(1)
    config = run_config(run_dir, "--run", [])
    refiners = list(config.experts.active_refiners())
    config = config.model_copy(update={"evaluation": config.evaluation.model_copy(update={"refine": bool(refiners)})})
    base = RolloutPipeline(config, device=local_device())  # the config's inits: the pretrained base
    sets = evaluate_sets(config, base)
    out = {"base_unrefined": {name: r["unrefined"][STRICT]["overall"] for name, r in sets.items()}}
    if refiners:
        out["base_refiners"] = {name: r["refined"][STRICT]["overall"] for name, r in sets.items()}
        if any(spec.train for spec in config.experts.active_refiners().values()):
            _, weights = latest_weights(run_dir, config.experts.ids())
            for eid in refiners:
                base.load(eid, 1, model_tensors(base.models[eid], weights[eid]))
            trained = evaluate_sets(config.model_copy(update={"evaluation": config.evaluation.model_copy(
                update={"refine": True})}), base)
            out["trained_refiners"] = {name: r["refined"][STRICT]["overall"] for name, r in trained.items()}
    (run_dir / "lever.json").write_text(json.dumps(out, indent=1))


def measure_transfer(gen_run: Path, refiner_runs: list[Path]) -> None:
    """transfer.json beside generator-only's run: its trained generator's strict accuracy on the
    run's evaluation sets from the original prompts, from the base refiners' prompts and from each
    of `refiner_runs`' trained refiners (same seed, so the same sets): whether what refiners learned
    still helps a generator that has learned by itself, the question PromptRL's gain rests on."""
    import torch

    from driver.checkpoint import latest_weights
    from driver.preflight import run_config
    from experts.devices import local_device
    from experts.pipeline import RolloutPipeline
    from experts.weights import model_tensors
    from tasks.evaluation import evaluate_sets
    torch.set_num_threads(1)
    config = run_config(refiner_runs[0], "--run", [])  # a config with refiners; models as generator-only's
    config = config.model_copy(update={"evaluation": config.evaluation.model_copy(update={"refine": True})})
    pipeline = RolloutPipeline(config, device=local_device())
    _, weights = latest_weights(gen_run, ["generator"])
    pipeline.load("generator", 1, model_tensors(pipeline.models["generator"], weights["generator"]))
    sets = evaluate_sets(config, pipeline)
    out = {"unrefined": {name: r["unrefined"][STRICT]["overall"] for name, r in sets.items()},
           "base_refiners": {name: r["refined"][STRICT]["overall"] for name, r in sets.items()}}
    refiners = list(config.experts.active_refiners())
    for version, run in enumerate(refiner_runs, start=1):
        _, weights = latest_weights(run, run_config(run, "--run", []).experts.ids())
        for eid in refiners:
            pipeline.load(eid, version, model_tensors(pipeline.models[eid], weights[eid]))
        sets = evaluate_sets(config, pipeline)
        out[run.name.rsplit("-seed", 1)[0]] = {name: r["refined"][STRICT]["overall"] for name, r in sets.items()}
    (gen_run / "transfer.json").write_text(json.dumps(out, indent=1))


def run_transfer(work: Path, seed: int, methods: list[str], code: str) -> dict | None:
    """The transfer measurement for one seed (a subprocess, one thread), reused when it has them all
    and was made from runs of the same code (`code`)."""
    gen_run, path = work / f"generator_only-seed{seed}", work / f"generator_only-seed{seed}" / "transfer.json"
    marker = path.with_name("transfer_code.txt")
    methods = [m for m in methods if m in TRANSFER]
    if not methods:
        return None
    if not (path.is_file() and set(methods) <= set(json.loads(path.read_text()))
            and marker.is_file() and marker.read_text() == code):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--transfer", str(gen_run),
               *[str(work / f"{m}-seed{seed}") for m in methods]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(work / f"transfer-seed{seed}.log", "w") as out:
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode:
                raise RuntimeError(f"the transfer measurement of seed {seed} failed; see {out.name}")
        marker.write_text(code)
    return json.loads(path.read_text())


# --- what the runs measured --------------------------------------------------------------------- #

DIAGNOSTICS = ("groups/zero_std/image", "groups/reward_std", "groups/similarity")  # image: the text terms
# give a joint run's groups spread in their total even where their images all score alike
DIAGNOSTIC_STEPS = 10  # a run's diagnostics "at the end": the mean over its last steps


def load(run_dir: Path, method: str) -> dict:
    """A run's curves: rollouts and strict accuracy at 0 (the base) and at every evaluation of each
    evaluation set (held_out, paraphrased, and any other the task has), as the method is used
    (refined where it has refiners) and unrefined; reward/image per step; the lever; the group
    diagnostics at the first step and over the last DIAGNOSTIC_STEPS."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lever = json.loads((run_dir / "lever.json").read_text())
    mode = "unrefined" if method == "generator_only" else "refined"
    start = lever["base_refiners" if mode == "refined" else "base_unrefined"]
    evals = [r for r in rows if f"eval/held_out/unrefined/{STRICT}" in r]
    names = [k.split("/")[1] for k in evals[0] if k.startswith("eval/") and k.endswith(f"/unrefined/{STRICT}")]
    curve = {f"{name}/{m}": np.array([start[name] if m == mode else lever["base_unrefined"][name]]
                                     + [r[f"eval/{name}/{m}/{STRICT}"] for r in evals])
             for name in names for m in dict.fromkeys((mode, "unrefined"))}
    diagnostics = {key: (rows[0][key], float(np.mean([r[key] for r in rows[-DIAGNOSTIC_STEPS:]])))
                   for key in DIAGNOSTICS if key in rows[0]}
    return {"rollouts": np.array([0] + [r["rollouts"] for r in evals]), "curve": curve, "mode": mode,
            "step_rollouts": np.array([r["rollouts"] for r in rows]),
            "reward": np.array([r["reward/image"] for r in rows]), "lever": lever,
            "extra": sum(r.get("counterfactual/generations", 0) for r in rows),
            "step_s": float(np.mean([r["time/step_s"] for r in rows])), "diagnostics": diagnostics}


def used(run: dict, name: str = "held_out") -> np.ndarray:
    """The strict accuracy curve of a set as the method is used."""
    return run["curve"][f"{name}/{run['mode']}"]


def final(values: np.ndarray) -> float:
    return float(values[-FINAL_EVALS:].mean())


def rollouts_to_reach(run: dict, target: float, name: str = "held_out") -> float:
    """Rollouts at the first evaluation where the mean of it and the one before reaches `target` on
    the evaluation set `name`; NaN if none does."""
    curve = used(run, name)
    pairs = np.convolve(curve, np.ones(SMOOTH) / SMOOTH, mode="valid")  # pairs[i]: evaluations i, i+1
    hit = np.nonzero(pairs >= target - 1e-9)[0]
    return float(run["rollouts"][hit[0] + SMOOTH - 1]) if len(hit) else float("nan")


def summarise(runs: dict[str, dict[int, dict]]) -> tuple[dict, dict]:
    """Per seed, the target is generator-only's final strict held-out accuracy on that seed (each
    seed has its own training prompts, so its own held-out set), and generator-only's rollouts to it;
    the × of a method on a seed is its rollouts to the target over the mean over seeds of
    generator-only's. A seed that never reaches the target counts as the whole budget (so the mean
    is a lower bound) and is counted as missed."""
    reference = runs["generator_only"]
    target = {seed: final(used(run)) for seed, run in reference.items()}
    partial = {seed: used(run)[0] + GAIN * (target[seed] - used(run)[0]) for seed, run in reference.items()}
    budget = float(next(iter(reference.values()))["rollouts"][-1])

    def reach(seeds: dict, to: dict) -> np.ndarray:
        return np.array([rollouts_to_reach(run, to[seed]) for seed, run in seeds.items()])
    mean_reach = float(np.nan_to_num(reach(reference, target), nan=budget).mean())
    mean_partial = float(np.nan_to_num(reach(reference, partial), nan=budget).mean())
    stats = {}
    for method, seeds in runs.items():
        full, part = reach(seeds, target), reach(seeds, partial)
        capped = np.nan_to_num(full, nan=budget)
        lever = [r["lever"] for r in seeds.values()]
        stats[method] = {
            "reach": capped, "missed": int(np.isnan(full).sum()), "ratio": capped / mean_reach,
            "ratio_gain": np.nan_to_num(part, nan=budget) / mean_partial, "missed_gain": int(np.isnan(part).sum()),
            "held": [final(used(r)) for r in seeds.values()],
            "para": [final(used(r, "paraphrased")) for r in seeds.values()],
            "unrefined": [final(r["curve"]["held_out/unrefined"]) for r in seeds.values()],
            "reward": [float(r["reward"][-10:].mean()) for r in seeds.values()],
            "lever": [x["trained_refiners"]["held_out"] - x["base_refiners"]["held_out"] for x in lever
                      if "trained_refiners" in x],
            "on_base": {source: [x[source]["held_out"] - x["base_unrefined"]["held_out"] for x in lever if source in x]
                        for source in ("base_refiners", "trained_refiners")},
            "extra": [r["extra"] for r in seeds.values()], "step_s": [r["step_s"] for r in seeds.values()]}
        stats[method]["drop"] = [h - p for h, p in zip(stats[method]["held"], stats[method]["para"])]
    info = {"target": float(np.mean(list(target.values()))), "reference": mean_reach, "budget": budget,
            "partial": float(np.mean(list(partial.values()))), "reference_gain": mean_partial,
            "base": float(np.mean([r["lever"]["base_unrefined"]["held_out"] for r in reference.values()]))}
    return stats, info


def fmt(values, digits=3, missed=0) -> str:
    """mean ± std over seeds, marked as a lower bound (>=) when `missed` seeds never got there."""
    values = np.asarray(values, dtype=float)
    if not len(values):
        return "–"
    text = f"{values.mean():.{digits}f} ± {values.std():.{digits}f}" if len(values) > 1 else f"{values[0]:.{digits}f}"
    return f">= {text} ({missed}/{len(values)} not reached)" if missed else text


def verdicts(stats: dict) -> list[str]:
    """The issue's bars, on the means over seeds, with the spread beside each."""
    ratio = {m: (float(np.mean(s["ratio"])), float(np.std(s["ratio"]))) for m, s in stats.items()}
    lines = []
    ran = [m for m in HEADLINE if m in stats]
    if ran:
        best = min(ran, key=lambda m: ratio[m][0])
        r, spread = ratio[best]
        reached = not stats[best]["missed"]
        verdict = ("met, and the moonshot" if r <= 0.33 else "met" if r <= 0.5 else "missed") if reached else "missed"
        lines.append(f"- best joint method, {best}, reaches generator-only's final strict held-out accuracy with "
                     f"{r:.2f}x ± {spread:.2f} of its rollouts (bar: <= 0.5x; moonshot 0.33x): {verdict}")
    spread = max(ratio[m][1] for m in stats)
    gain = max(float(np.std(s["ratio_gain"])) for s in stats.values())
    lines.append(f"- largest spread over seeds of a method's x: {spread:.2f} (the benchmark asks for < 0.25): "
                 f"{'met' if spread < 0.25 else 'missed'}; of its x {int(GAIN * 100)}%: {gain:.2f}")
    if all(m in stats for m in TEXT_STUDY):
        lines.append(text_study_verdict(stats))
    return lines


def text_study_verdict(stats: dict) -> str:
    """counterfactual >= per_expert > shared, each pair compared by the first measure that can tell
    it apart: rollouts to generator-only's final accuracy, else (where neither of the two reaches
    it on any seed, both x being the capped budget) to 80% of its gain, else final strict held-out."""
    measures = [("x generator-only", "ratio", "missed", -1), (f"x {int(GAIN * 100)}%", "ratio_gain", "missed_gain", -1),
                ("final strict held-out", "held", None, 1)]

    def compare(a: str, b: str) -> tuple[bool, str]:
        """(a is at least as good as b, the values it was decided on)."""
        name, key, missed, sign = next(m for m in measures if m[2] is None
                                       or any(stats[x][m[2]] < len(stats[x][m[1]]) for x in (a, b)))
        shown = " against ".join(f"{x} {fmt(stats[x][key], 3 if missed is None else 2, stats[x][missed] if missed else 0)}"
                                 for x in (a, b))
        return sign * np.mean(stats[a][key]) >= sign * np.mean(stats[b][key]), f"by {name}, {shown}"
    cf_pe, cf_pe_on = compare("counterfactual", "per_expert")
    sh_pe, sh_pe_on = compare("shared", "per_expert")  # per_expert > shared: shared not at least as good
    return (f"- text-term study, counterfactual >= per_expert > shared: {'met' if cf_pe and not sh_pe else 'missed'} "
            f"({cf_pe_on}; {sh_pe_on})")


def transfer_section(transfer: dict[int, dict | None], stats: dict) -> list[str]:
    """Generator-only's trained generator drawing from each source of prompts, beside the same
    refiners' lever on the frozen base."""
    seeds = [t for t in transfer.values() if t]
    if not seeds:
        return []
    unrefined = np.array([t["unrefined"]["held_out"] for t in seeds])
    lines = ["## Why: what refiners add to a generator that has learned", "",
             f"Generator-only's trained generator (its final checkpoint; seeds: {len(seeds)}) drawing from each source "
             "of prompts: strict held-out accuracy, and its gain over the same generator drawing from the original "
             "prompts; beside it, the same prompts' gain on the frozen base generator (from the runs' lever.json).",
             "", "| prompts from | trained generator: strict held-out | gain | base generator: gain |",
             "|---|---|---|---|", f"| the original prompts | {fmt(unrefined)} | – | – |"]
    for source in ("base_refiners", *TRANSFER):
        if source not in seeds[0]:
            continue
        held = np.array([t[source]["held_out"] for t in seeds])
        on_base = (next((stats[m]["on_base"]["base_refiners"] for m in TRANSFER if m in stats), [])
                   if source == "base_refiners" else stats[source]["on_base"]["trained_refiners"])
        name = "the base refiners" if source == "base_refiners" else f"{source}'s trained refiners"
        lines.append(f"| {name} | {fmt(held)} | {fmt(held - unrefined)} | {fmt(on_base)} |")
    return [*lines, ""]


def write_report(path: Path, stats: dict, info: dict, settings: dict, transfer: dict | None = None) -> None:
    quick = " --quick" if settings["quick"] else ""
    flags = quick + " --transfer-study" * bool(transfer) + "".join(f" --tune {t}" for t in settings["tune"])
    flags += f" --name {path.stem}" if path.stem != "learning" else ""
    lines = [f"# Learning benchmark: PromptRL's joint RL against generator-only Flow-GRPO{' (quick smoke run)' if quick else ''}",
             "", f"Written by `python bench/learning.py{flags}` on {settings['date']} in {settings['minutes']:.1f} min "
             f"({settings['reused']} of {settings['runs']} runs reused from an earlier invocation). "
             f"{settings['seeds']} seeds per method, {settings['steps']} steps of {settings['per_step']} rollouts "
             f"each ({settings['steps'] * settings['per_step']} per run), all from the base `{settings['base']}` "
             f"(code and base digest `{settings['code']}`); "
             f"strict accuracy on {settings['per_category']} held-out prompts per category (and their paraphrases), "
             f"evaluated every {settings['every']} steps.", "",
             f"Primary measure: strict held-out accuracy as the method is used (refined where it has refiners), "
             f"mean over the six categories. Target, per seed: generator-only's final value (mean of its last "
             f"{FINAL_EVALS} evaluations), **{info['target']:.3f}** on average (the base: {info['base']:.3f}); "
             f"generator-only first reaches it (two consecutive evaluations averaging at least it) after "
             f"**{info['reference']:.0f}** rollouts on average: the x column divides each seed's rollouts by that. "
             f"x {int(GAIN * 100)}%: the same for {int(GAIN * 100)}% of generator-only's gain from the base "
             f"(**{info['partial']:.3f}** on average, reached after **{info['reference_gain']:.0f}** rollouts). "
             "Values are mean ± standard deviation over seeds.", "",
             f"| method | rollouts to target | x generator-only | x {int(GAIN * 100)}% | final strict held-out | "
             "unrefined | paraphrased | drop | refiners' lever | final reward/image | extra generations | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, s in stats.items():
        lines.append(f"| {m} | {fmt(s['reach'], 0, s['missed'])} | {fmt(s['ratio'], 2, s['missed'])} | "
                     f"{fmt(s['ratio_gain'], 2, s['missed_gain'])} | "
                     f"{fmt(s['held'])} | {fmt(s['unrefined'])} | {fmt(s['para'])} | {fmt(s['drop'])} | "
                     f"{fmt(s['lever'])} | {fmt(s['reward'])} | {fmt(s['extra'], 0)} | {fmt(s['step_s'], 2)} |")
    lines += ["", "Unrefined: the same checkpoints drawing from the original prompts. Drop: held-out minus "
              "paraphrased. Refiners' lever: the frozen base generator's strict held-out accuracy from the "
              "trained refiners' prompts minus from the base refiners'. Extra generations: counterfactual "
              "regenerations (same noise, one refinement dropped), not counted in the rollout budget.", "",
              "## Bars", "", *verdicts(stats), "", *transfer_section(transfer or {}, stats), "## Methods", "",
              *[f"- {m}: `{' '.join(METHODS[m])}`" for m in stats],
              f"- every method with refiners: `{' '.join(REFINERS)}`",
              f"- the benchmark's settings on every method: `{' '.join(settings['bench'])}`",
              f"- overrides on every method: `{' '.join(settings['overrides']) or 'none'}`",
              f"- tuned (every method but generator-only): `{' '.join(settings['tune']) or 'none'}`", ""]
    path.write_text("\n".join(lines))


def trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """The mean over the last `window` values at each point (fewer at the start)."""
    c = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def plot(path: Path, runs: dict[str, dict[int, dict]], info: dict) -> None:
    """Strict held-out accuracy against rollouts (the headline methods, then the text-term study,
    each beside generator-only; band: min-max over seeds), and training reward/image."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = [("PromptRL's claim", [m for m in runs if m not in TEXT_STUDY]),
              ("the text-term credit study", ["generator_only", *[m for m in runs if m in TEXT_STUDY]])]
    groups = [g for g in groups if len(g[1]) > 1] or groups[:1]
    fig, axes = plt.subplots(1, len(groups) + 1, figsize=(6 * (len(groups) + 1), 4.5), dpi=110)
    colour = {m: f"C{i}" for i, m in enumerate(runs)}
    for ax, (title, methods) in zip(axes, groups):
        for method in methods:
            seeds = runs[method]
            x = next(iter(seeds.values()))["rollouts"]
            curves = np.stack([used(r) for r in seeds.values()])
            ax.plot(x, curves.mean(0), label=method, marker=".", color=colour[method])
            ax.fill_between(x, curves.min(0), curves.max(0), color=colour[method], alpha=0.08)
        ax.axhline(info["target"], color="grey", ls="--", lw=1, label="generator-only final")
        ax.set_xlabel("rollouts (training images)")
        ax.set_ylabel("strict held-out accuracy (as used)")
        ax.set_title(f"{title}: held-out strict accuracy", fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
    bx = axes[-1]
    for method, seeds in runs.items():
        steps = np.stack([r["reward"] for r in seeds.values()]).mean(0)
        bx.plot(next(iter(seeds.values()))["step_rollouts"], trailing_mean(steps, 10), color=colour[method],
                label=method)
    bx.set_xlabel("rollouts (training images)")
    bx.set_ylabel("reward/image (trailing 10-step mean, mean over seeds)")
    bx.set_title("training reward/image", fontsize=10)
    bx.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    if args.lever:
        measure_lever(args.lever)
        return 0
    if args.transfer:
        measure_transfer(args.transfer[0], args.transfer[1:])
        return 0
    start = time.perf_counter()
    seeds = args.seeds or (1 if args.quick else 5)
    bench = QUICK if args.quick else BENCH
    work = args.work or ROOT / "runs" / ("bench-learning-quick" if args.quick else "bench-learning")
    overrides = [*bench, *args.overrides]
    config = load_config("shapes", [*overrides, *args.tune])  # a bad override is refused before anything runs
    code = code_digest(config)
    methods = ["generator_only", *[m for m in args.methods if m != "generator_only"]]
    jobs = [(m, seed) for seed in range(seeds) for m in methods]
    reused = sum(finished(run_path(work, m, seed, args.tune), method_sets(overrides, m, seed, args.tune), code)
                 for m, seed in jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda job: run_one(*job, overrides, args.tune, work, code), jobs))
    runs: dict[str, dict[int, dict]] = {m: {} for m in methods}
    for (m, seed), d in zip(jobs, dirs):
        runs[m][seed] = load(d, m)
    stats, info = summarise(runs)
    transfer = {seed: run_transfer(work, seed, methods, code) for seed in range(seeds)} if args.transfer_study else {}
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"quick": args.quick, "runs": len(jobs), "reused": reused, "date": time.strftime("%Y-%m-%d"),
                "minutes": (time.perf_counter() - start) / 60, "seeds": seeds, "steps": config.trainer.steps,
                "per_step": config.trainer.prompts_per_step * config.algorithm.group_size,
                "per_category": config.evaluation.per_category, "every": config.evaluation.every, "bench": bench, "overrides": args.overrides,
                "tune": args.tune,
                "base": Path(config.experts.generator.init).parent.name, "code": code}
    report, picture = args.out / f"{args.name}.md", args.out / f"{args.name}.png"
    write_report(report, stats, info, settings, transfer)
    plot(picture, runs, info)
    print(report.read_text())
    print(f"bench: wrote {report} and {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
