"""The GPU acceptance run: a preset trained for a few steps on this machine's GPUs, checked against
its memory plan (driver/plan.py).

    bench/gpu_smoke.sh --preset sd3                 the preset's real models (from the Hugging Face
                                                    cache: `jointrl download --config sd3` first)
    bench/gpu_smoke.sh --preset flux2-klein --tiny  its family's tiny random stand-in under the
                                                    preset's sampler and loss settings, on one GPU
    bench/gpu_smoke.sh --preset all --tiny          every GPU preset's tiny stand-in, one after another
    bench/gpu_smoke.sh --preset gpu --random        the preset's real architectures with random
                                                    weights (`random:<hub id>`), built here: no hub
    options: --collective (weight sync by NCCL broadcast), --steps N (2), --prompts N, --run-dir DIR

With --random every generator and refiner the preset names by hub id is `random:<hub id>`
(common/random_models.py): the same architecture, dtype and token counts, so the same plan as the
real models, with random weights and stand-in tokenizers built on this machine before the run
(a few GB a second: SD3.5-medium with its T5-XXL is 16 GB in bfloat16); a preset whose reward terms
load models of their own is refused (no random stand-ins for them yet).

The run's config is the preset's, planned for this machine (`plan.target`: its GPUs and their
memory; with --tiny one GPU, and where vLLM is installed its refiner_0 sampled by a vLLM engine
on a tiny LM whose heads vLLM's attention serves), its batch cut to `--prompts` prompts per step (default: the fewest
that give every rollout worker one whole chunk of `rollout.batch_size`, so each actor still reaches
its planned peak). A plan that cannot fit stops here, naming why (exit 2). After the steps every
actor reports the GPU Ray gave it and its peak of allocated CUDA memory, and the run passes when:
- it completed: every step logged, every trained expert at version `steps`;
- the first update was on policy: `ppo/ratio_mean/<id>` within 1e-3 of 1 for every expert updated
  (a refiner sampled by a vLLM engine: within ENGINE_RATIO_TOL, its log-probs are the engine's
  kernels', not the trainer's; both bounds from bench/smoke_bounds.py);
- weights travelled as asked: every step's `sync/via` is `collective` with --collective, else
  `object_store`;
- the plan held: every planned GPU holds actors, the actors the plan puts on one GPU got one GPU id
  from Ray and those on different GPUs different ids, and each GPU's peak (its actors' peaks added,
  as the plan adds their bytes) is within 15 % of the plan's bytes for it. A GPU planned under 1 GB
  (the tiny stand-ins) is shown without a memory verdict: there the fixed costs the plan leaves to
  its headroom (cuBLAS workspaces, the allocator's rounding) are as large as what it counts.
It prints one table per run (per GPU: actors, planned, peak, ratio; then every check) and PASSED or
FAILED; the exit status is 0 only if every run passed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPU_PRESETS = ("gpu", "sd3", "flux1", "flux2-klein", "qwen-image", "geneval", "pickscore", "ocr")
TINY_FAMILY = {"sd3": "tiny:sd3", "flux1": "tiny:flux1", "flux2-klein": "tiny:flux2_klein",
               "qwen-image": "tiny:qwen_image", "gpu": "tiny:sd3"}
PRESET_GENERATOR_KEYS = ("sample_steps", "sde_window", "noise_level", "clip_eps", "kl_beta", "kl_form",
                         "train_final_step", "same_initial_noise", "train_cfg", "micro_batch")
RATIO_TOL, MEMORY_TOL, MEMORY_FLOOR = 1e-3, 0.15, 1e9
# a vLLM engine's refiner: at least 3 x the largest gap bench/smoke_bounds.py measured on the CPU (9.9e-4), widened
# for a GPU's bfloat16 decode (another kernel than the update's one pass: ~1e-2 per token)
ENGINE_RATIO_TOL = 1e-2
ENGINE_LM = "tiny:qwen2_engine"  # experts/tiny_hf.py tiny_engine_lm: heads of 32, which vLLM serves on CPU and GPU
RATIO_BOUND_MARGIN = 3.0  # RATIO_TOL: at least this times the largest gap bench/smoke_bounds.py measured
GB = 1e9


@dataclass(frozen=True)
class Check:
    """One line of the verdict: what was checked, what was seen, the bar, and whether it held (None:
    shown without a verdict)."""
    what: str
    seen: str
    bar: str
    ok: bool | None


@dataclass(frozen=True)
class GPURow:
    """One planned GPU: its actors, the bytes the plan gives it, the GPU ids Ray gave its actors and
    their peaks added."""
    gpu: int
    actors: list[str]
    planned: int
    ray_ids: list
    peak: int

    @property
    def ratio(self) -> float:
        return self.peak / self.planned if self.planned else math.nan


def tiny_overrides(preset: str) -> list[str]:
    """The preset's tiny stand-in: `prompts-tiny`'s task, data and reward terms with tiny random
    models of every kind, the preset's generator family (`tiny:<family>`) under its guidance,
    sampler and loss settings, and every actor on the GPU as the preset places its own."""
    from driver.config import resolve_config
    real = resolve_config(preset)
    g, m = real.experts.generator, real.experts.generator.model
    family = TINY_FAMILY.get(preset, "tiny:sd3")
    model = (f"{{kind: diffusers_flow, path: '{family}', dtype: bfloat16, guidance_scale: {m.guidance_scale}, "
             f"embedded_guidance: {getattr(m, 'embedded_guidance', 3.5)}, max_sequence_length: 16, "
             f"lora: {{r: 4, alpha: 8}}}}")
    out = [f"experts.generator.model={model}", "experts.refiner_defaults.model.dtype=bfloat16",
           *[f"experts.generator.{k}={json.dumps(getattr(g, k))}" for k in PRESET_GENERATOR_KEYS],
           f"algorithm.adv_std={real.algorithm.adv_std}", "experts.refiner_defaults.resources.num_gpus=1",
           "experts.generator.resources.num_gpus=1", "cluster.rollout_resources.num_gpus=1",
           "reward.resources.num_gpus=1", "evaluation.every=0"]
    for name in ("geneval", "pickscore"):  # prompts-tiny's pooled terms, on the GPU
        out.append(f"reward.terms.{name}.resources={{num_gpus: 1}}")
    return out + engine_overrides()


def engine_overrides() -> list[str]:
    """Where vLLM is installed, the stand-in's refiner_0 sampled by a vLLM engine (`engine: vllm`) on
    `ENGINE_LM`, with a KV cache of a set size (the plan counts it, and the GPU's other actors keep
    the rest); none where it is not."""
    if importlib.util.find_spec("vllm") is None:
        return []
    return ["experts.refiner_0.engine=vllm", f"experts.refiner_0.model.path={ENGINE_LM}",
            "experts.refiner_0.vllm.kv_cache_gib=0.25"]


def random_overrides(preset: str) -> list[str]:
    """The preset with each generator and refiner that names a hub id as `random:<hub id>`;
    SettingError if a reward term loads a model (none has a random stand-in)."""
    from common.hub import ModelRef
    from common.tiny import RANDOM
    from common.config import SettingError
    from driver.config import resolve_config
    from tasks.rewards import resolve
    real = resolve_config(preset)
    loaders = [name for name, term in real.reward.terms.items() if hasattr(resolve(term.fn), "models")
               and term.options() is not None and any(ref.on_hub for ref in resolve(term.fn).models(term.options()))]
    if loaders:
        raise SettingError(f"--random: the reward terms {', '.join(loaders)} of '{preset}' load models of their own, "
                          f"which have no random stand-in; run --tiny, or a preset whose reward needs no model (gpu)")
    return [f"experts.{e}.model.path={RANDOM}{real.expert(e).model.path}" for e in real.experts.ids()
            if real.expert(e).model.kind in ("hf_causal_lm", "diffusers_flow") and ModelRef(real.expert(e).model.path).on_hub]


def built_models(config) -> list[str]:
    """Build (or find) every `random:` model of the config's experts before the run, each timed
    and said (so that the actors find them built, and the build's time is not the run's)."""
    from common.hub import local_model
    from common.tiny import is_random
    names = list(dict.fromkeys(config.expert(e).model.path for e in config.experts.ids()
                               if is_random(getattr(config.expert(e).model, "path", None))))
    for name in names:
        start = time.perf_counter()
        folder = local_model(name)
        size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
        print(f"{name}: {size / GB:.1f} GB in {folder} ({time.perf_counter() - start:.0f} s)", flush=True)
    return names


def machine_target(tiny: bool) -> tuple[int, float]:
    """(GPUs, GB each) this run is planned for: this machine's (one of them with --tiny)."""
    import torch
    return (1 if tiny else torch.cuda.device_count()), torch.cuda.get_device_properties(0).total_memory / GB


def smoke_overrides(preset: str, tiny: bool, gpus: int, gpu_memory_gb: float, steps: int, collective: bool,
                    random: bool = False) -> tuple[str, list[str]]:
    """(the config source, its overrides) of the run, but for its batch (`smoke_config`)."""
    overrides = [f"trainer.steps={steps}", "logging.images_every=1", "logging.tensorboard=true",
                 "trainer.checkpoint_every_s=0", "plan.target.nodes=1", f"plan.target.gpus_per_node={gpus}",
                 f"plan.target.gpu_memory_gb={gpu_memory_gb:.3f}"]
    if tiny:
        overrides += tiny_overrides(preset)
    elif random:
        overrides += random_overrides(preset)
    if collective:
        overrides += ["cluster.sync=collective", "cluster.collective_backend=nccl"]
    return ("prompts-tiny" if tiny else preset), overrides


def smoke_config(preset: str, tiny: bool, gpus: int, gpu_memory_gb: float, steps: int, prompts: int | None,
                 collective: bool, random: bool = False):
    """The run's config: the preset (or its tiny stand-in, or its random weights), planned for
    `gpus` GPUs of `gpu_memory_gb`, `steps` steps of `prompts` prompts (None: `smallest_batch`)."""
    from driver.preflight import load_config
    source, overrides = smoke_overrides(preset, tiny, gpus, gpu_memory_gb, steps, collective, random)
    config = load_config(source, overrides)
    return load_config(source, [*overrides, f"trainer.prompts_per_step={prompts or smallest_batch(config)}"])


def smallest_batch(config) -> int:
    """The fewest prompts per step that give every rollout worker one whole chunk."""
    chunk = config.rollout.batch_size or 1
    return max(1, math.ceil(config.cluster.rollout_workers * chunk / config.algorithm.group_size))


def actor_report(actor) -> dict:
    """(Run inside an actor.) The GPU ids Ray gave it and its peak of allocated CUDA memory."""
    import ray
    import torch
    ids = [int(i) if str(i).isdigit() else i for i in ray.get_gpu_ids()]
    return {"gpus": ids, "peak": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0}


def gpu_rows(plan, reports: dict[str, dict]) -> list[GPURow]:
    """Per planned GPU that holds actors: what the plan gives it and what its actors reported."""
    rows = []
    for g in plan.gpus:
        if not g.actors:
            continue
        seen = [reports.get(a, {}) for a in g.actors]
        ids = sorted({i for r in seen for i in r.get("gpus", [])}, key=str)
        rows.append(GPURow(g.id, list(g.actors), g.bytes, ids, sum(r.get("peak", 0) for r in seen)))
    return rows


def checks(rows: list[dict], config, gpus: list[GPURow], asked_via: str) -> list[Check]:
    """The verdict of a finished run (module docstring), from its metrics rows, its config and its
    GPUs as planned and as seen."""
    steps, trained = config.trainer.steps, [e for e in config.experts.ids() if config.expert(e).train]
    versions = {e: rows[-1].get(f"version/{e}") for e in trained} if rows else {}
    out = [Check("completed", f"{len(rows)} steps; versions {versions}", f"{steps} steps, every trained expert "
                 f"at v{steps}", len(rows) == steps and all(v == steps for v in versions.values()))]
    first = rows[0] if rows else {}
    ratios = {k.rsplit("/", 1)[1]: v for k, v in first.items() if k.startswith("ppo/ratio_mean/")}
    engines = [e for e in trained if getattr(config.expert(e), "engine", "hf") == "vllm"]
    tol = {e: ENGINE_RATIO_TOL if e in engines else RATIO_TOL for e in trained}
    out.append(Check("first update on policy", ", ".join(f"{e} {r:.6f}" for e, r in ratios.items()) or "none",
                     f"|ppo/ratio_mean/<id> - 1| <= {RATIO_TOL:g} for every expert updated"
                     + (f" ({', '.join(engines)} on a vLLM engine: <= {ENGINE_RATIO_TOL:g})" if engines else ""),
                     bool(ratios) and set(ratios) == set(trained)
                     and all(abs(r - 1.0) <= tol[e] for e, r in ratios.items())))
    vias = [r.get("sync/via") for r in rows if r.get("sync/via") is not None]
    out.append(Check("weights travelled as asked", ", ".join(sorted(set(vias))) or "no sync",
                     f"sync/via = {asked_via} every step", bool(vias) and set(vias) == {asked_via}))
    ids = [tuple(g.ray_ids) for g in gpus]
    out.append(Check("every planned GPU used, as planned", "; ".join(f"GPU {g.gpu} -> Ray {list(g.ray_ids)}"
                                                                     for g in gpus),
                     "each planned GPU's actors on one Ray GPU, different GPUs on different ids, each with memory",
                     all(len(i) == 1 for i in ids) and len(set(ids)) == len(ids) and all(g.peak > 0 for g in gpus)))
    for g in gpus:
        measured = g.planned >= MEMORY_FLOOR
        out.append(Check(f"GPU {g.gpu} peak against the plan", f"{g.peak / GB:.2f} GB of {g.planned / GB:.2f} GB "
                         f"planned ({g.ratio:.2f})", f"within {MEMORY_TOL:.0%}" if measured else
                         f"none under {MEMORY_FLOOR / GB:g} GB planned",
                         abs(g.ratio - 1.0) <= MEMORY_TOL if measured else None))
    return out


def table(title: str, gpus: list[GPURow], verdict: list[Check]) -> str:
    """The run's table: its GPUs as planned and seen, then every check."""
    lines = [f"== {title}", f"{'GPU':>3}  {'Ray id':>6}  {'planned GB':>10}  {'peak GB':>8}  {'ratio':>5}  actors"]
    lines += [f"{g.gpu:>3}  {','.join(map(str, g.ray_ids)) or '-':>6}  {g.planned / GB:>10.2f}  {g.peak / GB:>8.2f}  "
              f"{g.ratio:>5.2f}  {', '.join(g.actors)}" for g in gpus]
    mark = {True: "ok", False: "FAILED", None: "-"}
    lines += [f"  [{mark[c.ok]:>6}] {c.what}: {c.seen} (bar: {c.bar})" for c in verdict]
    passed = all(c.ok is not False for c in verdict)
    lines.append(f"GPU SMOKE {title}: {'PASSED' if passed else 'FAILED'}")
    return "\n".join(lines)


def smoke(preset: str, tiny: bool, steps: int, prompts: int | None, collective: bool, run_dir: Path,
          random: bool = False) -> bool:
    """One preset's run on this machine's GPUs, its table printed; whether it passed."""
    import ray

    from cluster.runtime import get
    from driver.launch import start_driver, stop_driver
    from driver.plan import config_target, plan_for, report
    gpus, memory = machine_target(tiny)
    config = smoke_config(preset, tiny, gpus, memory, steps, prompts, collective, random)
    config.trainer.run_name = run_dir.name
    plan = plan_for(config, config_target(config))  # PlanError (exit 2): it cannot fit this machine
    print(report(plan), flush=True)
    built_models(config)
    ray.init(address="local", num_gpus=gpus, include_dashboard=False, namespace="jointrl")
    try:
        driver = start_driver(config, run_dir)
        try:
            get(driver.run.remote())
            reports = {name: ray.get(ray.get_actor(f"{config.trainer.run_name}/{name}", namespace="jointrl")
                                     .__ray_call__.remote(actor_report))
                       for name, a in plan.actors.items() if a.wants_gpu}
        finally:
            stop_driver(driver)
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    planned = gpu_rows(plan, reports)
    verdict = checks(rows, config, planned, "collective" if collective else "object_store")
    kind = " (tiny)" if tiny else " (random weights)" if random else ""
    print(table(f"{preset}{kind} on {gpus} GPU(s) of {memory:.0f} GB", planned, verdict),
          flush=True)
    return all(c.ok is not False for c in verdict)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpu", choices=(*GPU_PRESETS, "all"))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tiny", action="store_true", help="the preset's tiny random stand-in, on one GPU")
    mode.add_argument("--random", action="store_true",
                      help="the preset's real architectures with random weights built here (no hub)")
    p.add_argument("--collective", action="store_true", help="weight sync by NCCL broadcast")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: one chunk per worker)")
    p.add_argument("--run-dir", default=f"runs/gpu-smoke-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args()
    import torch

    from common.config import SettingError
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device: this acceptance run needs a GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
          flush=True)
    presets = GPU_PRESETS if args.preset == "all" else (args.preset,)
    passed, refused = [], []
    for preset in presets:
        run_dir = Path(args.run_dir) / preset
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            passed.append(smoke(preset, args.tiny, args.steps, args.prompts, args.collective, run_dir, args.random))
        except SettingError as e:  # its plan cannot fit this machine (or its config is wrong): said, not run
            print(f"gpu_smoke {preset}: {e}", file=sys.stderr, flush=True)
            refused.append(preset)
    print(f"GPU SMOKE: {sum(passed)} of {len(presets)} passed" + (f"; not run: {', '.join(refused)}" if refused else ""),
          flush=True)
    return 2 if refused else 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
