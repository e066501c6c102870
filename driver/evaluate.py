"""`jointrl eval`: strict accuracy per GenEval category on the held-out prompts and their paraphrases.

The held-out set is fixed by `evaluation.seed` and excludes every clause set of the run's training
prompts; the paraphrased copy has the same clauses in other words. A drop from held-out to
paraphrased measures prompt overfitting.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from cluster.rollout import RolloutWorker
from driver import checkpoint
from driver.config import ConfigError, run_config
from driver.images import grid, write_png
from experts.seeding import derive_seed
from tasks.shapes import CATEGORIES, eval_set, paraphrase, prompt_set


def held_out_sets(config) -> dict[str, list]:
    train = prompt_set(config.trainer.n_train_prompts, derive_seed(config.trainer.seed, "prompts"))
    held = eval_set(config.evaluation.per_category, config.evaluation.seed, exclude=train)
    return {"held_out": held, "paraphrased": [paraphrase(p) for p in held]}


def evaluate(config, weights: dict[str, dict] | None = None, samples_png: Path | None = None) -> dict:
    """Per set and category, the share of prompts whose image is strictly correct, for `weights`
    (else the models as the config builds them: fresh, or from their `init` checkpoints). With
    `samples_png`, the held-out images are written there as a grid, one row per category."""
    torch.set_num_threads(1)
    worker = RolloutWorker(config, 0)
    for eid, state in (weights or {}).items():
        worker.load_weights(eid, 0, state)
    report = {}
    for name, prompts in held_out_sets(config).items():
        result = worker.evaluate(prompts, refine=config.evaluation.refine)
        correct = np.array(result["correct"])
        cats = np.array([p.category for p in prompts])
        if samples_png and name == "held_out":
            per_row = min(config.evaluation.per_category, 10)
            rows = [result["images"][cats == c][:per_row] for c in CATEGORIES]
            write_png(samples_png, grid(np.concatenate(rows), cols=per_row))
        per = {c: float(correct[cats == c].mean()) for c in CATEGORIES}
        report[name] = {**per, "overall": float(np.mean(list(per.values())))}
    return report


def evaluate_run(run_dir: Path) -> dict:
    config = run_config(run_dir, "--run")
    ckpt, weights = checkpoint.latest_weights(run_dir, config.experts.ids())
    report = {"checkpoint": str(ckpt), **evaluate(config, weights, run_dir / "eval_samples.png")}
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
    report = {"checkpoint": str(base), **evaluate(base_config(config, base), samples_png=base / "eval_samples.png")}
    (base / "eval.json").write_text(json.dumps(report, indent=1))
    return report


def table(report: dict) -> str:
    sets = [k for k in ("held_out", "paraphrased") if k in report]
    rows = [f"{'category':<15}" + "".join(f"{s:>13}" for s in sets)]
    for c in (*CATEGORIES, "overall"):
        rows.append(f"{c:<15}" + "".join(f"{report[s][c]:>13.3f}" for s in sets))
    return "\n".join(rows)
