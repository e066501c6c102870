"""Evaluation of a task: every reward term on every evaluation set, with and without refinement.

One ODE sample per prompt, its draws seeded by the prompt's position, so an evaluation repeats
exactly, in `jointrl eval` and during training (`evaluation.every`) alike. Per set and mode
(`refined`, `unrefined`) the report holds, for each term, its mean overall and per metadata `tag`,
and for each term that has one (geneval, the shapes image term) its strict correctness
`<term>/strict` the same way, laid out as GenEval's table: "overall" is the mean over tags, as
GenEval averages its task accuracies (the mean over prompts where the prompts carry no tag).
Shapes' sets are the held-out prompts and their paraphrases: a drop from one to the other
measures prompt overfitting.
"""
from __future__ import annotations

import numpy as np


def modes(config) -> list[str]:
    """`unrefined`, and `refined` too where there are refiners and `evaluation.refine` asks."""
    refine = config.evaluation.refine and not config.experts.generator_only
    return ["refined", "unrefined"] if refine else ["unrefined"]


def eval_prompts(config, pipeline) -> dict[str, list]:
    """The task's evaluation sets, each cut to `evaluation.max_prompts`."""
    limit = config.evaluation.max_prompts
    return {name: prompts[:limit] for name, prompts in pipeline.task.eval_sets().items()}


def scored(pipeline, prompts: list, refine: bool, batch: int, *, progress=None) -> dict:
    """Every term (and strict measure) of one sample per prompt, drawn in parts of `batch`:
    {"terms", "strict", "valid", "images", "refinements"}."""
    parts = []
    for first in range(0, len(prompts), batch):
        parts.append(pipeline.evaluate(prompts[first:first + batch], refine, first=first))
        if progress:
            progress(len(prompts[first:first + batch]))
    joined = {key: {t: np.concatenate([p[key][t] for p in parts]) for t in parts[0][key]} for key in ("terms", "strict")}
    return {**joined, "valid": np.concatenate([p["valid"] for p in parts]),
            "images": np.concatenate([p["images"] for p in parts]),
            "refinements": [r for p in parts for r in p["refinements"]]}


def summary(values: np.ndarray, valid: np.ndarray, tags: list) -> dict:
    """{"overall", <tag>: mean} over the valid samples; overall is the mean over tags (if any)."""
    per = {}
    for tag in dict.fromkeys(t for t in tags if t is not None):
        sel = valid & np.array([t == tag for t in tags])
        per[str(tag)] = float(values[sel].mean()) if sel.any() else None
    means = [v for v in per.values() if v is not None]
    overall = float(np.mean(means)) if means else float(values[valid].mean()) if valid.any() else None
    return {"overall": overall, **per}


def measures(result: dict, prompts: list) -> dict[str, dict]:
    """`<term>` and `<term>/strict` -> their summary."""
    tags = [p.metadata.get("tag") for p in prompts]
    out = {t: summary(v, result["valid"], tags) for t, v in result["terms"].items()}
    out.update({f"{t}/strict": summary(v, result["valid"], tags) for t, v in result["strict"].items()})
    return out


def evaluate_sets(config, pipeline, progress=None, keep=None) -> dict:
    """{set: {mode: {measure: summary}}} of a rollout pipeline's weights; `keep(prompts, result)`
    is given the first set's first mode's samples (to be looked at)."""
    report = {}
    for n, (name, prompts) in enumerate(eval_prompts(config, pipeline).items()):
        report[name] = {}
        for m, mode in enumerate(modes(config)):
            result = scored(pipeline, prompts, mode == "refined", config.evaluation.batch_size, progress=progress)
            report[name][mode] = measures(result, prompts)
            if keep and n == 0 and m == 0:
                keep(prompts, result)
    return report
