"""`jointrl eval`: the report of tasks/evaluation.py at a run's latest checkpoint (or a pretrained
base), written to eval.json with its images (a video task's clips: animated, .gif and .mp4 where
imageio[ffmpeg] is installed), and printed as GenEval's table."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from common.config import SettingError
from driver.checkpoint import pipeline_at
from driver.images import grid, write_picture
from driver.plots import caption, sample_sheet
from experts.devices import local_device
from experts.pipeline import RolloutPipeline
from tasks.base import to_uint8
from tasks.evaluation import eval_prompts, evaluate_sets, modes

SHEET = 16  # images on an evaluation's captioned sample sheet


def evaluate(config, pipeline: RolloutPipeline, out_dir: Path | None = None, progress=None) -> dict:
    """{set: {mode: {measure: summary}}}. With `out_dir`, the first set's images are written there:
    eval_samples.png (a grid, one row per tag, the first mode) and eval_sheet.png (prompts,
    refinements and total rewards under the images)."""
    def keep(prompts, result):
        if out_dir is not None:
            write_samples(out_dir, config, prompts, result, weights=config.reward.weights)
    return evaluate_sets(config, pipeline, progress, keep)


def write_samples(out_dir: Path, config, prompts: list, result: dict, *, weights: dict) -> None:
    """eval_samples.png: one row per tag (a short row padded grey); eval_sheet.png: the first
    sample of each tag, then the second …, with prompts, refinements and total rewards (clips:
    eval_samples.gif and eval_sheet.gif, animated)."""
    tags = [p.metadata.get("tag") for p in prompts]
    order = list(dict.fromkeys(tags))
    per_row = min(max(tags.count(t) for t in order), 10)
    rows = [np.flatnonzero([t == tag for t in tags])[:per_row] for tag in order]
    blank = np.zeros_like(result["images"][0])
    tiles = [result["images"][i] for r in rows for i in r] if len(order) == 1 else \
        [result["images"][r[j]] if j < len(r) else blank for r in rows for j in range(per_row)]
    write_picture(out_dir / "eval_samples.png", grid(np.stack(tiles), cols=per_row), config.logging.fps)
    shown = [i for tagged in zip(*[list(r) + [None] * (per_row - len(r)) for r in rows]) for i in tagged
             if i is not None][:SHEET]
    total = sum(w * result["terms"][t] for t, w in weights.items())
    sample_sheet(np.stack([to_uint8(result["images"][i]) for i in shown]),
                 [caption(prompts[i].text, result["refinements"][i], float(total[i]) if result["valid"][i] else None)
                  for i in shown], "evaluation samples", out_dir / "eval_sheet.png", fps=config.logging.fps)


def evaluate_run(run_dir: Path, config, progress=None) -> dict:
    """`config` (the run's, with any keys set on top) evaluated at the run's latest checkpoint."""
    ckpt, pipeline = pipeline_at(run_dir, config)
    report = {"checkpoint": str(ckpt), "sets": evaluate(config, pipeline, run_dir, progress)}
    (run_dir / "eval.json").write_text(json.dumps(report, indent=1))
    return report


def base_config(config, base: Path):
    """`config` starting from the pretrained base in `base`, evaluated without refinement."""
    for name in ("generator", "text_encoder"):
        if not (base / f"{name}.safetensors").is_file():
            raise SettingError(f"--base '{base}' holds no {name}.safetensors (expected the folder `jointrl pretrain` "
                              f"wrote)")
    return config.model_copy(update={
        "experts": config.experts.model_copy(update={
            "generator": config.experts.generator.model_copy(update={"init": str(base / "generator.safetensors")}),
            "text_encoder": config.experts.text_encoder.model_copy(update={"init": str(base / "text_encoder.safetensors")})}),
        "evaluation": config.evaluation.model_copy(update={"refine": False})})


def evaluate_base(config, base: Path, progress=None) -> dict:
    config = base_config(config, base)
    torch.set_num_threads(1)
    report = {"checkpoint": str(base), "sets": evaluate(config, RolloutPipeline(config, device=local_device()), base,
                                                        progress)}
    (base / "eval.json").write_text(json.dumps(report, indent=1))
    return report


def size(config, pipeline) -> int:
    """How many samples an evaluation draws (for its progress bar)."""
    return sum(len(p) for p in eval_prompts(config, pipeline).values()) * len(modes(config))


def table(report: dict) -> str:
    """The strict measures per tag (GenEval's table), then every measure's overall, one column per
    set and mode."""
    sets = report["sets"]
    columns = [(name, mode) for name, by_mode in sets.items() for mode in by_mode]
    head = "".join(f"{name + '/' + mode:>24}" for name, mode in columns)
    first = sets[columns[0][0]][columns[0][1]]

    def cell(value) -> str:
        return f"{'-' if value is None else f'{value:.3f}':>24}"
    lines = []
    for measure in [m for m in first if m.endswith("/strict")]:
        lines += [f"{measure + ' per tag':<22}{head}"]
        for tag in [*(k for k in first[measure] if k != "overall"), "overall"]:
            lines.append(f"  {tag:<20}" + "".join(cell(sets[n][m][measure].get(tag)) for n, m in columns))
    lines += [f"{'mean of every term':<22}{head}"]
    for measure in first:
        lines.append(f"  {measure:<20}" + "".join(cell(sets[n][m][measure]["overall"]) for n, m in columns))
    return "\n".join(lines)
