"""When does joint RL win? PromptRL's mechanisms as settings of the shapes world, each measured
against generator-only Flow-GRPO from the same base and the same rollout budget.

PromptRL (arXiv 2602.01382) credits its gain over Flow-GRPO (arXiv 2505.05470) to three things:
groups whose samples look alike (no spread for the group-relative advantage), prompt overfitting,
and a generator that reads some language poorly while the LM knows it. Each is a setting here:

    control        the default world (the `shapes` preset as it ships)
    low_diversity  every sample of a prompt starts from the same noise and the sampler's SDE noise
                   is 0.1 (bench/results/low-diversity.md: image zero_std 0.66 at the first step)
    rare_wording   half the training prompts say colours, shapes, counts and relations in rare
                   synonyms that the base saw in 1% of its captions and the refiners' supervised
                   start in half of theirs; held-out accuracy in both wordings
    all            low_diversity and rare_wording together

and in each, four methods from bench/learning.py: generator_only (the reference);
promptrl_replace, PromptRL as its code trains (shared advantage, the generator reading the
refinements in place of the prompt, 2 original samples of 8), so `task.compose=replace` is measured
in every setting; promptrl_counterfactual, the best joint method of bench/results/learning.md
(it appends the refinements); and promptrl_rewrite, PromptRL's single rewriter: one LM whose
supervised start restates the whole request in its usual words, read in place of the prompt
(the three refiners of the others write detail segments too short to carry a request); and
promptrl_rewrite_detail, that rewriter beside two detail refiners (`pretrain.rewrite_shares`), each
paid by its counterfactual D_k, the generator reading the rewrite and the details in place of the
prompt: the rewriter for the rare words, the detail refiners for the spread within a group. Runs,
their reuse and their measures are learning.py's: rollouts to
reach generator-only's final strict held-out accuracy (per seed), final strict accuracy on the
held-out set (and on it said in rare words where the setting has them), the group diagnostics at
the first step and over the last ten, and the refiners' lever on the frozen base.

Usage:
  python bench/settings.py [--quick] [--seeds 5] [--settings control ...] [--methods ...] [--jobs 2]
Writes NAME.md and NAME.png (default `settings`, quick: `settings-quick`) in --out.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from driver.preflight import load_config  # noqa: E402
from learning import (BENCH, DIAGNOSTICS, METHODS, REFINERS, code_digest, final, finished, fmt, load,  # noqa: E402
                      method_sets, rollouts_to_reach, run_one, run_path, summarise, used)

LOW_DIVERSITY = ["experts.generator.same_initial_noise=true", "experts.generator.noise_level=0.1"]
RARE = ["task.rare_wording=0.5", f"experts.base={ROOT / 'configs' / 'bases' / 'shapes-rare'}"]
SETTINGS = {"control": [], "low_diversity": LOW_DIVERSITY, "rare_wording": RARE, "all": [*LOW_DIVERSITY, *RARE]}
COMPARED = ("generator_only", "promptrl_replace", "promptrl_counterfactual", "promptrl_rewrite",
            "promptrl_rewrite_detail")
# The quick run: one seed, a fifth of the steps, a sixth of the held-out prompts; the same settings
# and methods, so it shows whether the ordering holds before hours are spent on the full one.
QUICK = ["evaluation.every=10", "evaluation.per_category=16", "evaluation.batch_size=48",
         "trainer.prompts_per_step=8", "trainer.steps=30"]
RARE_SET = "rare_wording"
REWRITERS = ("promptrl_rewrite", "promptrl_rewrite_detail")  # whose text is longer than the base's captions


def base_inits(setting: list[str]) -> list[str]:
    """The generator's and text encoder's files of a setting's base, named: a base is made for the
    refiners' detail segments (bench/results/settings.notes.md), and promptrl_rewrite's rewriter,
    whose longer text it reads in place of the prompt, would otherwise ask for a base of its own."""
    config = load_config("shapes", setting)
    return [f"experts.generator.init={config.experts.generator.init}",
            f"experts.text_encoder.init={config.experts.text_encoder.init}"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, 30 steps, a small held-out set (meant for 15 min)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 5; quick: 1)")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), help="the settings to run")
    p.add_argument("--methods", nargs="+", choices=COMPARED[1:], default=list(COMPARED[1:]),
                   help="the joint methods to run beside generator_only, the reference")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each uses one thread)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the report and plot go")
    p.add_argument("--name", default=None, help="the report's and plot's file name (default settings[-quick])")
    p.add_argument("--work", type=Path, default=None, help="where runs go (default runs/bench-settings[-quick])")
    p.add_argument("--report-only", action="store_true", help="rewrite the report and plot from the finished runs in "
                                                              "--work, whatever code made them (trains nothing)")
    return p.parse_args()


def cell_stats(runs: dict[str, dict[int, dict]]) -> tuple[dict, dict]:
    """learning.summarise's per-method figures, with the rare-worded held-out accuracy, its drop
    from the usual wording, and each diagnostic at the start and the end (mean over seeds)."""
    stats, info = summarise(runs)
    rare_ratio = rare_rollouts(runs)
    for method, seeds in runs.items():
        s = stats[method]
        has_rare = all(f"{RARE_SET}/{r['mode']}" in r["curve"] for r in seeds.values())
        s["rare"] = [final(used(r, RARE_SET)) for r in seeds.values()] if has_rare else []
        s["rare_drop"] = [h - r for h, r in zip(s["held"], s["rare"])]
        s["rare_ratio"], s["rare_missed"] = rare_ratio.get(method, ([], 0))
        s["diagnostics"] = {key: tuple(float(np.mean([r["diagnostics"][key][i] for r in seeds.values()]))
                                       for i in (0, 1))
                            for key in DIAGNOSTICS if all(key in r["diagnostics"] for r in seeds.values())}
    return stats, info


def rare_rollouts(runs: dict[str, dict[int, dict]]) -> dict[str, tuple[np.ndarray, int]]:
    """Per method, `summarise`'s x generator-only measured on the rare-worded held-out set: rollouts to
    generator-only's final rare-worded accuracy on the same seed over generator-only's mean (a seed
    that never gets there counts as the whole budget), and how many seeds never do; {} where the runs
    have no rare wording."""
    if not all(f"{RARE_SET}/{r['mode']}" in r["curve"] for seeds in runs.values() for r in seeds.values()):
        return {}
    reference = runs["generator_only"]
    target = {seed: final(used(run, RARE_SET)) for seed, run in reference.items()}
    budget = float(next(iter(reference.values()))["rollouts"][-1])
    reach = {m: np.array([rollouts_to_reach(r, target[seed], RARE_SET) for seed, r in seeds.items()])
             for m, seeds in runs.items()}
    own = float(np.nan_to_num(reach["generator_only"], nan=budget).mean())
    return {m: (np.nan_to_num(r, nan=budget) / own, int(np.isnan(r).sum())) for m, r in reach.items()}


def verdict(setting: str, stats: dict) -> str:
    """The issue's bar for one setting, in plain words: does a joint method reach generator-only's
    final strict held-out accuracy with at most half its rollouts (spread over seeds < 0.25), and
    does generator-only lose more than it from the usual to the rare wording?"""
    joint = [m for m in stats if m != "generator_only"]
    best = min(joint, key=lambda m: (float(np.mean(stats[m]["ratio"])), -float(np.mean(stats[m]["held"]))))
    s, g = stats[best], stats["generator_only"]
    ratio, spread, seeds = float(np.mean(s["ratio"])), float(np.std(s["ratio"])), len(s["ratio"])
    wins = not s["missed"] and ratio <= 0.5 and spread < 0.25 and seeds > 1
    held = float(np.mean(s["held"])) - float(np.mean(g["held"]))
    words = [f"**{setting}**: the best joint method, {best}, needs {ratio:.2f}x ± {spread:.2f} of generator-only's "
             f"rollouts to reach its final strict held-out accuracy"
             + (f" ({s['missed']} of {len(s['ratio'])} seeds never do)" if s["missed"] else "")
             + f" and ends {held:+.3f} from it ({fmt(s['held'])} against {fmt(g['held'])})."]
    if s["rare"] and g["rare"]:
        gd, jd = float(np.mean(g["rare_drop"])), float(np.mean(s["rare_drop"]))
        words.append(f"From the usual to the rare wording generator-only drops {gd:.3f} and {best} {jd:.3f}"
                     f" ({'larger' if gd > jd else 'not larger'} for generator-only).")
        rare = max(joint, key=lambda m: float(np.mean(stats[m]["rare"])))
        r = stats[rare]
        if len(r["rare_ratio"]):
            x, sx = float(np.mean(r["rare_ratio"])), float(np.std(r["rare_ratio"]))
            met = not r["rare_missed"] and x <= 0.5 and sx < 0.25 and len(r["rare_ratio"]) > 1
            words.append(f"On the rare-worded held-out prompts {rare} reaches generator-only's final accuracy there "
                         f"with {x:.2f}x ± {sx:.2f} of its rollouts"
                         + (f" ({r['rare_missed']} of {len(r['rare_ratio'])} seeds never do)" if r["rare_missed"] else "")
                         + (": the bar's measure met on that set." if met else "."))
    fewer_drop = not s["rare"] or float(np.mean(g["rare_drop"])) > float(np.mean(s["rare_drop"]))
    if wins and fewer_drop:
        words.append("Joint RL **wins** here by the bar (<= 0.5x, spread < 0.25)" + (
            "." if s["rare"] else "; this setting has no rare wording, so the bar's clause on the drop to it "
                                  "is not measured here."))
    elif seeds == 1 and not s["missed"] and ratio <= 0.5 and fewer_drop:
        words.append("On this one seed it meets the bar's 0.5x; whether the spread over seeds is under 0.25 "
                     "needs more seeds.")
    else:
        words.append("Joint RL does not win here by the bar (<= 0.5x, spread < 0.25).")
    return " ".join(words)


def arrow(pair: tuple[float, float] | None) -> str:
    return f"{pair[0]:.2f} → {pair[1]:.2f}" if pair else "–"


def write_report(path: Path, cells: dict[str, tuple[dict, dict]], meta: dict, methods: list[str]) -> None:
    quick = " --quick" if meta["quick"] else ""
    lines = [f"# When joint RL wins: PromptRL's mechanisms as settings of the shapes world{' (quick run)' if quick else ''}",
             "", (f"Rewritten by `python bench/settings.py{quick}{meta['flags']} --report-only --work "
                  f"{meta['report_only']}` on {meta['date']} from its {meta['runs']} finished runs (the code that "
                  f"made them is not checked). " if meta.get("report_only") else
                  f"Written by `python bench/settings.py{quick}{meta['flags']}` on {meta['date']} in "
                  f"{meta['minutes']:.1f} min ({meta['reused']} of {meta['runs']} runs reused). ")
             + f"{meta['seeds']} seed(s) "
             f"per cell, {meta['steps']} steps of {meta['per_step']} rollouts each; {meta['per_category']} held-out "
             f"prompts per category, evaluated every {meta['every']} steps. Each setting starts from its own base "
             "(the rare wording's holds the rare words) and compares with its own generator-only runs.", "",
             "x generator-only: rollouts to reach generator-only's final strict held-out accuracy on the same seed, "
             "over generator-only's own (a seed that never does counts as the whole budget: >=). Rare: strict "
             "accuracy on the same held-out prompts said in rare synonyms; drop: usual minus rare; x generator-only "
             "(rare): the same measure on the rare-worded prompts. Diagnostics: "
             "the first step → the mean of the last ten (image zero_std: share of groups whose image term has no "
             "spread; reward_std: mean within-group standard deviation of the total; similarity: mean pairwise "
             "Pearson correlation of a group's 8x8-pooled images). Lever: the frozen base generator's strict held-out accuracy from the trained refiners' prompts minus from the "
             "base refiners'. Values: mean ± standard deviation over seeds.", "",
             "| setting | method | x generator-only | final strict held-out | rare | drop to rare | x generator-only "
             "(rare) | image zero_std | reward_std | similarity | lever |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for setting, (stats, _) in cells.items():
        for method, s in stats.items():
            d = s["diagnostics"]
            lines.append(f"| {setting} | {method} | {fmt(s['ratio'], 2, s['missed'])} | {fmt(s['held'])} | "
                         f"{fmt(s['rare'])} | {fmt(s['rare_drop'])} | {fmt(s['rare_ratio'], 2, s['rare_missed'])} | "
                         f"{arrow(d.get(DIAGNOSTICS[0]))} | "
                         f"{arrow(d.get(DIAGNOSTICS[1]))} | {arrow(d.get(DIAGNOSTICS[2]))} | {fmt(s['lever'])} |")
    lines += ["", "## Verdicts", "", *[f"- {verdict(setting, stats)}" for setting, (stats, _) in cells.items()],
              "", "## Settings and methods", "",
              *[f"- {name}: `{' '.join(SETTINGS[name]).replace(f'{ROOT}/', '') or 'the defaults'}`" for name in cells],
              *[f"- {m}: `{' '.join(METHODS[m])}`" for m in methods],
              f"- every method with refiners: `{' '.join(REFINERS)}`",
              f"- the benchmark's settings on every run: `{' '.join(meta['bench'])}`", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, cells: dict[str, tuple[dict, dict]], runs: dict[str, dict]) -> None:
    """One column per setting: strict held-out accuracy against rollouts, generator-only and each joint
    method on the same axes (band: min-max over seeds); a second row, where a setting has a rare
    wording, on its rare-worded prompts."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rare = {s: bool(len(stats["generator_only"]["rare"])) for s, (stats, _) in cells.items()}
    rows = 2 if any(rare.values()) else 1
    fig, axes = plt.subplots(rows, len(cells), figsize=(4.5 * len(cells), 4 * rows), dpi=110, squeeze=False)
    for column, (setting, (stats, info)) in enumerate(cells.items()):
        sets = [("held_out", info["target"], "")] + (
            [(RARE_SET, float(np.mean(stats["generator_only"]["rare"])), ": the rare-worded prompts")] if rare[setting] else [])
        for row, (name, target, said) in enumerate(sets):
            ax = axes[row][column]
            for i, (method, seeds) in enumerate(runs[setting].items()):
                x = next(iter(seeds.values()))["rollouts"]
                curves = np.stack([used(r, name) for r in seeds.values()])
                ax.plot(x, curves.mean(0), label=method, marker=".", color=f"C{i}")
                ax.fill_between(x, curves.min(0), curves.max(0), color=f"C{i}", alpha=0.1)
            ax.axhline(target, color="grey", ls="--", lw=1, label="generator-only final")
            ax.set_title(setting + said, fontsize=10)
            ax.set_xlabel("rollouts (training images)")
            ax.set_ylabel("strict held-out accuracy (as used)" if column == 0 or said else "")
        for row in range(len(sets), rows):
            axes[row][column].axis("off")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    seeds = args.seeds or (1 if args.quick else 5)
    bench = QUICK if args.quick else BENCH
    work = args.work or ROOT / "runs" / ("bench-settings-quick" if args.quick else "bench-settings")
    methods = [m for m in COMPARED if m == COMPARED[0] or m in args.methods]
    code = {s: code_digest(load_config("shapes", [*bench, *SETTINGS[s]])) for s in args.settings}
    jobs = [(s, m, seed) for seed in range(seeds) for s in args.settings for m in methods]
    overrides = {(s, m): [*bench, *SETTINGS[s], *(base_inits([*bench, *SETTINGS[s]]) if m in REWRITERS else [])]
                 for s in args.settings for m in methods}
    sets = {(s, m, seed): method_sets(overrides[s, m], m, seed, []) for s, m, seed in jobs}
    if args.report_only:
        dirs = [run_path(work / s, m, seed, []) for s, m, seed in jobs]
        missing = [str(d) for d in dirs if not (d / "lever.json").is_file()]
        if missing:
            sys.exit(f"bench: --report-only: no finished run in {', '.join(missing)}")
        reused = len(jobs)
    else:
        reused = sum(finished(run_path(work / s, m, seed, []), sets[s, m, seed], code[s]) for s, m, seed in jobs)
        print(f"bench: {len(jobs)} runs ({reused} reused), {args.jobs} at once", flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            dirs = list(pool.map(lambda j: run_one(j[1], j[2], overrides[j[0], j[1]], [], work / j[0], code[j[0]]),
                                 jobs))
    runs: dict[str, dict[str, dict[int, dict]]] = {s: {m: {} for m in methods} for s in args.settings}
    for (s, m, seed), d in zip(jobs, dirs):
        runs[s][m][seed] = load(d, m)
    cells = {s: cell_stats(runs[s]) for s in args.settings}
    config = load_config("shapes", bench)
    name = args.name or ("settings-quick" if args.quick else "settings")
    flags = (f" --seeds {seeds}" if args.seeds else "") + (
        f" --settings {' '.join(args.settings)}" if args.settings != list(SETTINGS) else "") + (
        f" --methods {' '.join(methods[1:])}" if methods != list(COMPARED) else "")  # the joint ones, as given
    meta = {"quick": args.quick, "flags": flags, "date": time.strftime("%Y-%m-%d"), "reused": reused,
            "minutes": (time.perf_counter() - start) / 60, "runs": len(jobs), "seeds": seeds,
            "steps": config.trainer.steps, "per_step": config.trainer.prompts_per_step * config.algorithm.group_size,
            "per_category": config.evaluation.per_category, "every": config.evaluation.every, "bench": bench,
            "report_only": str(work) if args.report_only else None}
    args.out.mkdir(parents=True, exist_ok=True)
    report, picture = args.out / f"{name}.md", args.out / f"{name}.png"
    write_report(report, cells, meta, methods)
    plot(picture, cells, runs)
    print(report.read_text())
    print(f"bench: wrote {report} and {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
