"""`jointrl eval`: the task's measure (shapes: strict accuracy) per metadata tag on each of its
evaluation sets (shapes: held-out prompts and their paraphrases; a drop from one to the other
measures prompt overfitting)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from driver.checkpoint import pipeline_at
from driver.config import ConfigError
from driver.images import grid, write_png
from experts.pipeline import RolloutPipeline


def evaluate(config, pipeline: RolloutPipeline, samples_png: Path | None = None) -> dict:
    """Per evaluation set and tag, the mean measure of one ODE sample per prompt. With
    `samples_png`, the first set's images are written there as a grid, one row per tag."""
    report = {}
    for n, (name, prompts) in enumerate(pipeline.task.eval_sets().items()):
        result = pipeline.evaluate(prompts, refine=config.evaluation.refine)
        tags = np.array([p.metadata["tag"] for p in prompts])
        order = list(dict.fromkeys(tags))
        if samples_png and n == 0:
            per_row = min(config.evaluation.per_category, 10)
            write_png(samples_png, grid(np.concatenate([result["images"][tags == t][:per_row] for t in order]),
                                        cols=per_row))
        per = {t: float(result["measure"][tags == t].mean()) for t in order}
        report[name] = {**per, "overall": float(np.mean(list(per.values())))}
    return report


def evaluate_run(run_dir: Path, config) -> dict:
    """`config` (the run's, with any keys set on top) evaluated at the run's latest checkpoint."""
    ckpt, pipeline = pipeline_at(run_dir, config)
    report = {"checkpoint": str(ckpt), **evaluate(config, pipeline, run_dir / "eval_samples.png")}
    (run_dir / "eval.json").write_text(json.dumps(report, indent=1))
    return report


def base_config(config, base: Path):
    """`config` starting from the pretrained base in `base`, evaluated without refinement."""
    for name in ("generator", "text_encoder"):
        if not (base / f"{name}.safetensors").is_file():
            raise ConfigError(f"--base '{base}' holds no {name}.safetensors (expected the folder `jointrl pretrain` "
                              f"wrote)")
    return config.model_copy(update={
        "experts": config.experts.model_copy(update={
            "generator": config.experts.generator.model_copy(update={"init": str(base / "generator.safetensors")}),
            "text_encoder": config.experts.text_encoder.model_copy(update={"init": str(base / "text_encoder.safetensors")})}),
        "evaluation": config.evaluation.model_copy(update={"refine": False})})


def evaluate_base(config, base: Path) -> dict:
    config = base_config(config, base)
    torch.set_num_threads(1)
    report = {"checkpoint": str(base), **evaluate(config, RolloutPipeline(config), base / "eval_samples.png")}
    (base / "eval.json").write_text(json.dumps(report, indent=1))
    return report


def table(report: dict) -> str:
    sets = [k for k, v in report.items() if isinstance(v, dict)]
    rows = [f"{'tag':<15}" + "".join(f"{s:>13}" for s in sets)]
    for tag in report[sets[0]]:
        rows.append(f"{tag:<15}" + "".join(f"{report[s][tag]:>13.3f}" for s in sets))
    return "\n".join(rows)
