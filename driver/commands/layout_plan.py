"""`jointrl plan`'s comparison of the two layouts (`cluster.layout`): each one's memory per device
and estimated synchronous step time, and which is faster.

The step's time, phases one after another, each as long as its busiest device: a phase costs its
per-sample cost on one device times the samples that device takes.
The two layouts are compared on the same devices: the separate layout's rollout workers are the
colocated layout's extra generator ranks (`as_layout`).
- separate: the rollout is every refiner's refinement and the generation of a worker's share, on
  `cluster.rollout_workers` workers; the weight sync is left out (bench/results/sync.md).
- colocated: each refiner's ranks refine their share (the refiners at once), then the generator's
  ranks generate theirs.
- both: the update is the slowest expert's share of its samples, on its `parallel.ranks` ranks.
Per-sample costs: tiny builds are measured on this CPU (one step in-process after one that warms
up); real models from FLOPs at the target GPU's peak (`plan.target.gpu_tflops`). The generator's
pass costs what its trace counts (experts/memory.py `Flops`): its matrix products, and attention's,
which grow with the square of the tokens (at Wan's 33 k tokens attention is ~2.4x the rest). A
backward pass costs twice the forward's products (once under LoRA: no weight gradients) and 2.5x
its attention (FlashAttention-2, arXiv 2307.08691 §4.1: the backward recomputes the scores); under
activation checkpointing the forward runs twice. A refiner's pass costs 2 x parameters x tokens
(its few hundred tokens make attention small). Real steps take longer than that bound, by about
the same factor in either layout, so the comparison holds where the absolute figure does not: on
one CPU thread, at the CPU's own rate, each family's passes take 1.08x to 1.24x what this model
says (bench/time_model.py).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

from cluster.layouts import LAYOUTS
from common.config import SettingError
from driver.config import Config, validated
from driver.plan import (PROMPT_TOKENS, PlanError, Target, guided, plan_for, refined_samples, step_samples,
                         task_generator, trained_steps)
from experts.memory import Flops, lm_architecture

REFUSED = "the config refuses it: "  # how a layout the config's validation refuses is reported


@dataclass(frozen=True)
class PhaseCosts:
    """Seconds one device takes per sample: each refiner's refinement (per refined sample), the
    generation (sample, decode, score, counterfactual regenerations), each trained expert's update
    (per sample it learns from); `source` says how they were found."""
    refine: dict[str, float]
    generate: float
    update: dict[str, float]
    source: str


@dataclass(frozen=True)
class LayoutEstimate:
    """One layout of a config: who rolls out (`shape`), the devices holding a model, the largest
    bytes one of them holds (per actor in `bytes`), and the estimated phases of a synchronous step."""
    layout: str
    shape: str
    devices: int
    bytes: dict[str, int]
    rollout_s: float
    update_s: float

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.update_s

    @property
    def peak_bytes(self) -> int:
        return max(self.bytes.values(), default=0)


def as_layout(config: Config, layout: str) -> Config:
    """`config` under `layout` on the same devices: from separate to colocated the rollout workers'
    devices become more ranks of the generator; from colocated to separate as many of the
    generator's ranks become `cluster.rollout_workers` workers (where it has more ranks than that;
    else the workers are devices more). The settings the other layout refuses are dropped
    (staleness under colocated, offload under separate)."""
    if config.cluster.layout == layout:
        return config
    other = config.model_copy(deep=True)
    other.cluster.layout = layout
    parallel, workers = other.experts.generator.parallel, config.cluster.rollout_workers
    if layout == "colocated":
        other.cluster.max_staleness = 0
        parallel.ranks = min(parallel.ranks + workers, step_samples(config))
    else:
        other.cluster.offload = []
        parallel.ranks = parallel.ranks - workers if parallel.ranks > workers else parallel.ranks
    if parallel.ranks == 1:
        parallel.defer_gradient_sync, parallel.reshard_after_forward = False, True
    return other


def is_tiny(config: Config) -> bool:
    """Whether the generator is a tiny build (a tiny kind or a `tiny:<kind>` model), whose FLOPs no
    architecture counts: its costs are measured here (with the refiners, whatever they are)."""
    m = config.experts.generator.model
    return m.kind in ("tiny_dit", "tiny_video_dit") or str(getattr(m, "path", "")).startswith("tiny:")


def trained(config: Config) -> list[str]:
    return [e for e in config.experts.ids() if config.expert(e).train]


def sampled_pass_flops(flops: Flops) -> float:
    """One forward pass without gradients: its products and its attention."""
    return flops.linear + flops.attention


def trained_pass_flops(flops: Flops, *, lora: bool, checkpointing: bool, reference: bool) -> float:
    """One trained step through one transformer: the forward, the backward (twice the forward's
    products, once under LoRA; 2.5x its attention), the forward again under activation
    checkpointing, and the frozen reference's forward (`reference`: the KL's)."""
    backward = (1 if lora else 2) * flops.linear + 2.5 * flops.attention
    return sampled_pass_flops(flops) * (1 + checkpointing + reference) + backward


def flop_costs(config: Config, tflops: float) -> PhaseCosts:
    """Per-sample costs from FLOPs at `tflops` (see the module docstring)."""
    rate = tflops * 1e12
    g = config.experts.generator
    arch = task_generator(config, g.model)  # a video model's clip size too
    algo = config.algorithm
    redraws = algo.counterfactual_fraction * len(config.experts.active_refiners()) \
        * refined_samples(config) / step_samples(config) if algo.credit == "counterfactual" else 0.0
    text = 2 * sum(arch.frontend.values()) * arch.text_tokens  # the encoders' passes (the VAE's are left out)
    generate = (1 + redraws) * (g.sample_steps * guided(g) * sampled_pass_flops(arch.flops) + text)

    def generator_update(spec) -> float:
        passes = trained_pass_flops(arch.flops, lora=bool(spec.model.lora),
                                    checkpointing=spec.parallel.activation_checkpointing, reference=spec.kl_beta > 0)
        return (guided(g) if g.train_cfg else 1) * passes
    refine, update = {}, {}
    for e, r in config.experts.active_refiners().items():
        lm = lm_architecture(r.model)
        seq = PROMPT_TOKENS + r.max_new_tokens
        forward_lm = 2 * lm.params * seq
        refine[e] = forward_lm / rate
        update[e] = forward_lm * (2 + (not r.model.lora) + r.parallel.activation_checkpointing + (r.kl_beta > 0)) / rate
    if config.experts.generator_low is None:
        update["generator"] = len(trained_steps(g)) * generator_update(g) / rate
    else:  # Wan2.2-A14B's two transformers, each its own expert, each training the steps it denoises
        from common.architectures import config_folder, model_index
        from experts.wan import transformer_steps
        folder = config_folder(g.model.path, g.model.revision)
        boundary = model_index(folder)["boundary_ratio"]
        sides, _ = transformer_steps(folder, g.sample_steps, trained_steps(g), boundary)
        for e, side in (("generator", "high"), ("generator_low", "low")):
            update[e] = len(sides[side]) * generator_update(config.expert(e)) / rate
    return PhaseCosts(refine, generate / rate, {e: update[e] for e in trained(config)},
                      f"FLOPs at {tflops:g} TFLOP/s per GPU (plan.target.gpu_tflops)")


def measured_costs(config: Config) -> PhaseCosts:
    """Per-sample costs of the config's tiny builds measured here, in one process on one thread:
    step 0 warms up, step 1 is timed."""
    import numpy as np
    import torch

    from algorithm.batch import step_samples as samples_of
    from experts.expert import Expert
    from experts.pipeline import RolloutPipeline, refine_samples
    from tasks import build_task
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipeline = RolloutPipeline(config)
        experts = {e: Expert(config, e) for e in trained(config)}
        prompts, t, a = build_task(config).train_prompts(), config.trainer, config.algorithm
        draws = np.random.default_rng(t.seed)
        for step in (0, 1):
            samples = samples_of(prompts, step=step, seed=t.seed, prompts_per_step=t.prompts_per_step,
                                 group_size=a.group_size, num_skip_refinement=a.num_skip_refinement,
                                 refine=not config.experts.generator_only)
            refined = [s for s in samples if s.refine]
            refinements, tokens, refine, update = [{} for _ in samples], {}, {}, {}
            rows = [i for i, s in enumerate(samples) if s.refine]
            for e in pipeline.refiner_ids:
                start = time.perf_counter()
                made, tokens[e] = refine_samples(pipeline.models[e], e, t.seed, step, samples=refined,
                                                 device=pipeline.device)
                refine[e] = (time.perf_counter() - start) / max(len(refined), 1)
                for i, refinement in zip(rows, made):
                    refinements[i][e] = refinement
            start = time.perf_counter()
            out = pipeline.run(step, samples, refinements)
            generate = (time.perf_counter() - start) / len(samples)
            for e, expert in experts.items():
                inputs = (draws.standard_normal(len(samples)), out.trajectories) if e == "generator" \
                    else (draws.standard_normal(len(refined)), tokens[e])
                start = time.perf_counter()
                expert.update(step, expert.version, *inputs)
                update[e] = (time.perf_counter() - start) / len(inputs[0])
    finally:
        torch.set_num_threads(threads)
    return PhaseCosts(refine, generate, update, "measured on this machine's CPU (tiny builds; one thread)")


def estimate(config: Config, costs: PhaseCosts, target: Target) -> LayoutEstimate:
    """`config`'s layout (as it is set) on `target`: memory per device from the plan, phases from `costs`."""
    n, n_refined = step_samples(config), refined_samples(config)

    def learns(e: str) -> int:
        return n if e == "generator" else n_refined
    update = max((cost * math.ceil(learns(e) / config.ranks(e)) for e, cost in costs.update.items()), default=0.0)
    layout = LAYOUTS[config.cluster.layout]
    rollout = layout.rollout_seconds(refine=costs.refine, generate=costs.generate, samples=n, refined=n_refined,
                                     ranks={e: config.ranks(e) for e in config.experts.ids()},
                                     workers=config.cluster.rollout_workers)
    plan = plan_for(config, target)
    held = {name: a.total for name, a in plan.actors.items() if name.startswith(("expert/", "rollout/"))}
    shape = layout.who_rolls_out(generator_ranks=config.ranks("generator"), workers=config.cluster.rollout_workers)
    return LayoutEstimate(config.cluster.layout, shape, len(held), held, rollout, update)


def compare(config: Config, target: Target, costs: PhaseCosts | None = None) -> dict:
    """Both layouts of `config` on the same devices (`as_layout`) on `target`: {"costs",
    "separate", "colocated", "faster"}; a layout that cannot fit, or that the config refuses, is why."""
    costs = costs or (measured_costs(config) if is_tiny(config) else flop_costs(config, config.plan.target.gpu_tflops))
    out = {}
    for layout in LAYOUTS:
        other = as_layout(config, layout)
        try:
            validated(other.model_dump())  # a layout this config refuses is never the one recommended
            out[layout] = estimate(other, costs, target)
        except SettingError as e:
            why = str(e).removeprefix("invalid config: ").removesuffix(" Nothing was started.")
            out[layout] = f"{REFUSED}{why.replace('config: Value error, ', '')}"
        except PlanError as e:  # the other layout may not fit where the config's own does
            out[layout] = str(e)
    fits = [layout for layout in LAYOUTS if isinstance(out[layout], LayoutEstimate)]
    return {"costs": costs, **out, "faster": min(fits, key=lambda layout: out[layout].step_s) if fits else None}


def compare_json(comparison: dict) -> dict:
    """The comparison for `jointrl plan --json` (a layout that cannot fit: {"error": why})."""
    def one(e):
        return {**asdict(e), "step_s": e.step_s, "peak_bytes": e.peak_bytes} if isinstance(e, LayoutEstimate) \
            else {"error": e}
    return {"costs": asdict(comparison["costs"]), "faster": comparison["faster"],
            **{layout: one(comparison[layout]) for layout in LAYOUTS}}


def compare_report(comparison: dict) -> str:
    """The comparison as a person reads it."""
    costs = comparison["costs"]
    lines = [f"layouts (synchronous step; per-sample costs {costs.source}):"]
    for layout in LAYOUTS:
        e = comparison[layout]
        if not isinstance(e, LayoutEstimate):
            lines.append(f"  {layout:9s}: {'' if e.startswith(REFUSED) else 'cannot fit: '}{e}")
            continue
        lines.append(f"  {layout:9s}: {e.shape}; {e.devices} devices, at most {e.peak_bytes / 1e9:.2f} GB on one; "
                     f"rollout {e.rollout_s:.3g} s + update {e.update_s:.3g} s = {e.step_s:.3g} s a step")
    other = [x for x in LAYOUTS if x != comparison["faster"]][0]
    if not isinstance(comparison[other], LayoutEstimate):
        return "\n".join(lines + [f"  faster: {comparison['faster'] or 'neither fits'}"])
    ratio = comparison[comparison["faster"]].step_s / max(comparison[other].step_s, 1e-12)
    lines.append(f"  faster: {comparison['faster']} ({ratio:.2f} x the {other} layout's step time)")
    return "\n".join(lines)
