"""`jointrl sample`: one prompt, refined by the trained refiners and drawn by the trained generator:
a PNG grid of its images, or for a video task an animated grid of its clips (a GIF, and an MP4
beside it where imageio[ffmpeg] is installed).

The prompt is checked against the task's vocabulary first: an empty, over-long or unknown-word
prompt is an error that names it, before anything is loaded.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from common.config import SettingError
from driver import checkpoint
from driver.images import grid, write_picture
from tasks.base import TextPrompt
from tasks.shapes import encode_words
from tasks.shapes_video import encode_video_words

CHUNK = 64  # images drawn at once: memory stays bounded whatever -n is


def reads_word_ids(config) -> bool:
    """Whether a model of the run reads prompts as shapes word ids (the tiny LM or tiny DiT's encoder)."""
    kinds = [r.model.kind for r in config.experts.active_refiners().values()] + [config.experts.generator.model.kind]
    return any(k in ("tiny_lm", "tiny_dit", "tiny_video_dit") for k in kinds)


def user_prompt(text: str, config) -> TextPrompt:
    """A user's prompt as the models read it (it has no metadata: nothing scores it). Models of the
    shapes vocabulary need its words; Hugging Face and diffusers models read any text."""
    words = text.lower().split() if reads_word_ids(config) else text.split()
    if reads_word_ids(config):
        try:
            (encode_video_words if config.task.name == "shapes_video" else encode_words)(words)
        except ValueError as e:
            raise SettingError(f"--prompt {text!r}: {e}. Nothing was drawn.") from None
    elif not words:
        raise SettingError(f"--prompt {text!r}: an empty prompt. Nothing was drawn.")
    return TextPrompt(" ".join(words))


def sample_run(run_dir: Path, config, text: str, n: int = 4, *, seed: int = 0, out: Path | None = None) -> dict:
    """`n` images (clips) of `text` from the latest checkpoint of `run_dir`, written as one PNG grid
    (an animated one, `out` with suffix .gif, and .mp4); returns {"files" (the grid first), "checkpoint",
    "refinements" (one dict per image, refiner id -> words)}."""
    prompt = user_prompt(text, config)
    if out is not None and out.is_dir():
        raise SettingError(f"--out '{out}' is a folder; name the PNG file to write. Nothing was drawn.")
    image_bytes = 3 * config.task.image_size ** 2 * 4 * (config.task.num_frames or 1)
    if 2 * n * image_bytes > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2:
        raise SettingError(f"-n {n}: {n} images of {config.task.image_size} px would not fit in half of this "
                          f"machine's memory; draw fewer. Nothing was drawn.")
    ckpt, pipeline = checkpoint.pipeline_at(run_dir, config)
    parts = [pipeline.draw([prompt] * min(CHUNK, n - i), refine=not config.experts.generator_only,
                           tag=f"sample/{seed}", first=i) for i in range(0, n, CHUNK)]
    drawn = {"images": np.concatenate([d["images"] for d in parts]),
             "refinements": [r for d in parts for r in d["refinements"]]}
    out = out or Path(run_dir) / "samples" / f"{re.sub(r'[^a-z0-9]+', '-', prompt.text.lower()).strip('-')}-seed{seed}.png"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        files = write_picture(out, grid(drawn["images"], cols=min(n, 8)), config.logging.fps)
    except OSError as e:
        raise SettingError(f"--out '{out}': cannot write it ({e.strerror}); name a writable PNG file.") from None
    return {"files": files, "checkpoint": ckpt, "refinements": drawn["refinements"]}
