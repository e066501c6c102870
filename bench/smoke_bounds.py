"""The GPU smoke run's first-step ratio bound, measured: each GPU preset's tiny stand-in in bfloat16 on the CPU.

bench/gpu_smoke.py passes a run whose first update was on policy: `ppo/ratio_mean/<id>` near 1
for every expert it updated. In bfloat16 the log-probabilities an update recomputes differ from
the ones its rollout recorded, by the rounding of another order of operations: a refiner decodes
token by token with a KV cache where its update reads the whole text in one pass, and a generator's
transformer runs a batch of another size. This script runs exactly what `gpu_smoke.sh --preset <p>
--tiny` runs (its own overrides: the preset's sampler and loss settings, bfloat16 refiners and
generator, one step; where vLLM is installed, refiner_0 sampled by a vLLM engine), but inline on
the CPU, for --seeds seeds, and reports |ratio_mean - 1| per expert, the largest per kind, and the
bounds that the smoke run's table uses: RATIO_BOUND_MARGIN times the largest seen over the HF
loop's refiners and the generators (RATIO_TOL), and over the engine's refiners (ENGINE_RATIO_TOL:
the engine's log-probs come from its own kernels, not the trainer's). A GPU's kernels round in
another order again; the margin is for that, not measured here.

    python bench/smoke_bounds.py [--presets sd3 flux1 ...] [--seeds 2] [--out bench/results]

It writes bench/results/smoke_bounds.md (and prints it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_smoke import GPU_PRESETS, RATIO_BOUND_MARGIN, smoke_config, smoke_overrides  # noqa: E402

KINDS = ("HF loop", "vLLM engine")  # how a refiner samples; the generator is counted with the HF loop

ON_THE_CPU = ["cluster.mode=inline", "logging.tensorboard=false", "logging.images_every=0", "logging.report=false",
              "experts.refiner_defaults.resources.num_gpus=0", "experts.generator.resources.num_gpus=0",
              "cluster.rollout_resources.num_gpus=0", "reward.resources.num_gpus=0",
              "reward.terms.geneval.resources={num_gpus: 0}", "reward.terms.pickscore.resources={num_gpus: 0}"]


def first_ratios(preset: str, seed: int, work: Path, refiner: str | None) -> tuple[dict[str, float], set[str]]:
    """({expert: ppo/ratio_mean of the first step, and each refiner's largest per-token log-prob gap
    as "<id> gap_max"}, the refiners sampled by an engine) of the preset's tiny stand-in (its
    refiners' model `refiner` if given), one step inline."""
    _, overrides = smoke_overrides(preset, True, 1, 80.0, 1, False)
    config = smoke_config(preset, True, 1, 80.0, 1, None, False)
    prompts = config.trainer.prompts_per_step
    engines = {e for e, r in config.experts.active_refiners().items() if r.engine == "vllm"}
    sets = [*overrides, f"trainer.prompts_per_step={prompts}", *ON_THE_CPU, f"trainer.seed={seed}",
            *([f"experts.refiner_defaults.model.path={refiner}", "experts.refiner_defaults.max_new_tokens=48"]
              if refiner else [])]
    run_dir = work / f"{preset}-seed{seed}"
    cmd = [sys.executable, "-m", "driver", "train", "--config", "prompts-tiny", "--run-dir", str(run_dir),
           *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{preset} seed {seed} failed:\n{done.stderr[-3000:]}")
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {**{k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith("ppo/ratio_mean/")},
            **{f"{k.split('/')[1]} gap_max": v for k, v in row.items() if k.endswith("/logprob_gap_max")}}, engines


def report(found: dict[tuple[str, int], tuple[dict[str, float], set[str]]], seeds: int, minutes: float,
           refiner: str | None) -> str:
    kinds = {kind: [] for kind in KINDS}
    flags = f" --seeds {seeds}" + (f" --refiner {refiner}" if refiner else "")
    lines = ["# The GPU smoke run's first-step ratio bound", "",
             f"`python bench/smoke_bounds.py{flags}` ({minutes:.0f} min on this machine's CPU): each GPU preset's "
             "tiny stand-in (`gpu_smoke.sh --preset <p> --tiny`'s config: bfloat16 refiners and generator, the "
             "preset's sampler and loss settings; a refiner marked (vLLM) sampled by a vLLM engine) trained one "
             "step inline, |ppo/ratio_mean - 1| per expert, and each refiner's largest per-token "
             "|trainer - rollout| log-prob gap.", "",
             "| preset | seed | refiner_0 | refiner_1 | generator | refiner_0 gap_max | refiner_1 gap_max |",
             "|---|---|---|---|---|---|---|"]
    for (preset, seed), (ratios, engines) in found.items():
        cells = []
        for e in ("refiner_0", "refiner_1", "generator"):
            gap = abs(ratios[e] - 1.0) if e in ratios else None
            cells.append("–" if gap is None else f"{gap:.1e}" + (" (vLLM)" if e in engines else ""))
            if gap is not None:
                kinds[KINDS[e in engines]].append(gap)
        cells += [f"{ratios[k]:.1e}" if k in ratios else "–" for k in ("refiner_0 gap_max", "refiner_1 gap_max")]
        lines.append(f"| {preset} | {seed} | " + " | ".join(cells) + " |")
    names = {"HF loop": "RATIO_TOL", "vLLM engine": "ENGINE_RATIO_TOL"}
    lines += ["", *[f"- bound, {kind}: {RATIO_BOUND_MARGIN:g} x the largest gap {max(gaps):.1e} = "
                    f"**{RATIO_BOUND_MARGIN * max(gaps):.1e}** (`{names[kind]}` in bench/gpu_smoke.py must be at "
                    f"least this)" for kind, gaps in kinds.items() if gaps],
              "- what this cannot say: these are a CPU's bfloat16 kernels (for the engine, vLLM's CPU backend); a "
              "GPU's round in another order again (and decode with a KV cache in other kernels than one pass), so "
              "they are floors for the bounds, not the GPU's gaps; the first GPU smoke run prints its own ratios"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", choices=GPU_PRESETS, default=list(GPU_PRESETS))
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--refiner", default=None, help="the refiners' model instead of the stand-in's tiny:qwen2, e.g. "
                                                   "random:Qwen/Qwen2.5-0.5B-Instruct (the gpu preset's architecture; "
                                                   "48 new tokens)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    start, found = time.perf_counter(), {}
    with tempfile.TemporaryDirectory(prefix="jointrl-bounds-") as work:
        for preset in args.presets:
            for seed in range(args.seeds):
                found[preset, seed] = first_ratios(preset, seed, Path(work), args.refiner)
                print(f"{preset} seed {seed}: " + ", ".join(f"{e} {r:.6f}" for e, r in found[preset, seed][0].items()),
                      flush=True)
    text = report(found, args.seeds, (time.perf_counter() - start) / 60, args.refiner)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "smoke_bounds.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
