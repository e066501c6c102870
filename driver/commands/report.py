"""`jointrl report RUN_DIR`: a run's curves and samples as PNG files in RUN_DIR/report/.

rewards.png (total and every term), experts.png (each refiner's own reward), versions.png (every
expert's version over steps), timing.png (step, rollout, update, sync and idle seconds),
staleness.png (each expert's lag, asynchronous runs), losses.png, and samples.png: the latest
logged samples (`logging.images_every`) with their original and refined prompts, or, if the run
logged none, one sample per held-out prompt drawn from its latest checkpoint. A video task's
samples are clips: samples.gif, an animated sheet (and samples.mp4 where imageio[ffmpeg] is
installed).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.config import SettingError
from driver.images import FPS
from driver.metrics import parse
from driver.plots import caption, curves, sample_sheet
from tasks.base import to_uint8


def metric_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = [r for r in (parse(line) for line in (path.read_text().splitlines() if path.is_file() else [])) if r]
    if not rows:
        raise SettingError(f"report '{run_dir}': no metrics there yet (no rows in {path})")
    return rows


def keys(rows: list[dict], prefix: str, exclude: tuple[str, ...] = ()) -> list[str]:
    seen = dict.fromkeys(k for r in rows for k in r if k.startswith(prefix) and k not in exclude)
    return list(seen)


def latest_samples(run_dir: Path) -> tuple[np.ndarray, list[str], str, float | None] | None:
    """(images or clips, captions, title, frames per second) of the newest sheet the run logged, if any."""
    logged = sorted((Path(run_dir) / "samples").glob("step_*.json"))
    if not logged:
        return None
    meta = json.loads(logged[-1].read_text())
    images = np.load(logged[-1].with_suffix(".npy"))
    captions = [caption(p, r, w) for p, r, w in zip(meta["prompts"], meta["refinements"], meta["rewards"])]
    return images, captions, f"samples at step {meta['step']}", meta.get("fps")


def drawn_samples(run_dir: Path, config, n: int = 8) -> tuple[np.ndarray, list[str], str, float]:
    """One ODE sample per tag of the task's first evaluation set (then more of its prompts, up to
    `n`), from the latest checkpoint, with its refinements."""
    from driver.checkpoint import pipeline_at
    ckpt, pipeline = pipeline_at(run_dir, config)
    held = next(iter(pipeline.task.eval_sets().values()))
    firsts = {}
    for i, p in enumerate(held):
        firsts.setdefault(p.metadata.get("tag"), i)
    order = [*firsts.values(), *(i for i in range(len(held)) if i not in firsts.values())]
    prompts = [held[i] for i in order[:n]]
    drawn = pipeline.draw(prompts, refine=not config.experts.generator_only, tag="report")
    images = np.stack([to_uint8(im) for im in drawn["images"]])
    return images, [caption(p.text, r, None) for p, r in zip(prompts, drawn["refinements"])], \
        f"held-out prompts, {ckpt.name}", config.logging.fps


def report(run_dir: Path, config) -> tuple[list[Path], str | None]:
    """Write every plot of `run_dir` into RUN_DIR/report/; returns (the files written, why there is
    no sample sheet, if there is none). Any run with metrics has curves, whether or not it finished
    or checkpointed; `config()` gives the run's config, read only if samples must be drawn."""
    run_dir = Path(run_dir)
    rows = metric_rows(run_dir)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    refiners = sorted({k.split("/")[1] for k in keys(rows, "version/refiner_")})
    plots = [
        curves(rows, ["reward/total", *[k for k in keys(rows, "reward/", ("reward/total",))
                                        if k.split("/")[1] not in refiners]],
               "reward: total and every term", "mean reward", path=out / "rewards.png"),
        curves(rows, [f"reward/{e}" for e in refiners], "each refiner's own reward (the terms it owns)",
               "mean reward", path=out / "experts.png"),
        curves(rows, keys(rows, "version/"), "versions", "version", path=out / "versions.png"),
        curves(rows, ["time/step_s", "time/rollout_s", "time/update_s", "time/sync_s", "time/idle_s"],
               "time per step", "seconds", path=out / "timing.png"),
        curves(rows, keys(rows, "staleness/"), "staleness: versions behind, per expert", "versions",
               path=out / "staleness.png"),
        curves(rows, keys(rows, "loss/"), "losses", "loss", path=out / "losses.png"),
    ]
    written, missing = [p for p in plots if p is not None], None
    try:
        images, captions, title, fps = latest_samples(run_dir) or drawn_samples(run_dir, config())
        written.append(sample_sheet(images, captions, title, out / "samples.png", fps=fps or FPS))
    except SettingError as e:  # no checkpoint (yet) to draw samples from: the curves stand alone
        missing = str(e)
    return written, missing
