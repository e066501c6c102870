"""`jointrl score`: one reward term on a folder of images, one image per prompt, to check a reward
(its model, its options, what it makes of known images) before training with it.

The term is the config's `reward.terms.<NAME>` or, where the config has no such term, the built-in
NAME with its default options; `--set reward.terms.NAME.<key>=…` changes its options either way.
Everything the user names is checked before any model loads: the term's options, packages and
models (preflight), the prompts, and every image (PNG or JPEG, read with its EXIF orientation, as
RGB), whose count must equal the prompts'. Images pair with prompts in name order, numbers by value
(`2.png` before `10.png`).

An image reaches the term as generated images do, (3, H, W) in [-1, 1] (`tasks.base.from_uint8`:
each 8-bit value in the middle of those `to_uint8` turns back into it), so a term that reads pixels
(every built-in does, through `to_uint8`) sees exactly the file's.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config import SettingError
from driver.config import Config, invalid, resolve_config
from tasks.base import from_uint8

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
CHUNK = 16  # images held in memory at once for a term without a batch_size


@dataclass
class Scored:
    """What `jointrl score` reports: the term, each image's file and score, and GenEval-style 0/1
    correctness where the term has a `strict` score."""
    term: str
    fn: str
    files: list[Path]
    prompts: list[Any]
    scores: np.ndarray
    strict: np.ndarray | None

    def mean(self) -> float | None:
        finite = self.scores[np.isfinite(self.scores)]
        return float(finite.mean()) if finite.size else None

    def as_json(self) -> dict:
        values = [float(s) if math.isfinite(s) else None for s in self.scores]
        out = {"term": self.term, "fn": self.fn, "mean": self.mean(), "scores": values,
               "files": [f.name for f in self.files]}
        if self.strict is not None:
            out["strict"] = self.strict.tolist()
        return out


def term_config(source: str, overrides: list[str], name: str) -> tuple[Config, Any]:
    """The config and its term `name`: the config's own, or the built-in `name` with its defaults
    added to it (so the overrides of `reward.terms.name.*` and every error read as in a run)."""
    from tasks.rewards import BUILTINS
    prefix = f"reward.terms.{name}"
    own = [o for o in overrides if o.startswith((prefix + ".", prefix + "="))]
    config = resolve_config(source, [o for o in overrides if o not in own])
    if name in config.reward.terms:
        config = resolve_config(source, overrides)
    elif name in BUILTINS:
        config = resolve_config(source, [*[o for o in overrides if o not in own], f"{prefix}.fn={name}", *own])
    else:
        raise SettingError(f"--term {name}: not a reward term of --config {source} ({', '.join(config.reward.terms)}) "
                          f"nor a built-in ({', '.join(BUILTINS)}). Nothing was started.")
    return config, config.reward.terms[name]


def natural_key(path: Path) -> list:
    """Name order with runs of digits compared as numbers: 2.png before 10.png."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def image_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise SettingError(f"--images '{folder}' is not a folder. Nothing was started.")
    files = sorted((p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES),
                   key=natural_key)
    if not files:
        raise SettingError(f"--images '{folder}' holds no PNG or JPEG images. Nothing was started.")
    return files


def read_image(path: Path) -> np.ndarray:
    """The image as (H, W, 3) uint8 RGB, turned upright by its EXIF orientation; a file that
    cannot be decoded is a SettingError naming it."""
    from PIL import Image, ImageOps
    try:
        with Image.open(path) as image:
            return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise SettingError(f"--images: '{path}' cannot be read as an image ({type(e).__name__}: {e}). "
                          f"Nothing was started.") from None


def chunks(sizes: list[tuple[int, int]], most: int) -> list[slice]:
    """Runs of consecutive images of one size, at most `most` long: the batches the term is called on."""
    out, start = [], 0
    for i in range(1, len(sizes) + 1):
        if i == len(sizes) or sizes[i] != sizes[start] or i - start == most:
            out.append(slice(start, i))
            start = i
    return out


def checked_inputs(config: Config, prompts_file: str, folder: Path) -> tuple[list, list[Path], list[tuple[int, int]]]:
    """The prompts, the image files and their sizes, every one read: a SettingError names the first
    file at fault, before any model loads."""
    from tasks.prompt_data import PromptDataError, load_prompts
    try:
        prompts = load_prompts(prompts_file, config.task.text_field)
    except PromptDataError as e:
        raise SettingError(f"--prompts: {e}. Nothing was started.") from None
    files = image_files(folder)
    if len(files) != len(prompts):
        raise SettingError(f"--images '{folder}' holds {len(files)} images (PNG/JPEG) and --prompts '{prompts_file}' "
                          f"{len(prompts)} prompts: one image per prompt, paired in name order. Nothing was started.")
    sizes = [read_image(f).shape[:2] for f in files]
    return prompts, files, sizes


def score_folder(config: Config, name: str, term, prompts_file: str, *, folder: Path, device,
                 progress=lambda n: None) -> Scored:
    """Score every image of `folder` against its prompt with the term `name` (see the module docstring)."""
    from common.loading import ModelLoadError
    from driver.download import term_models
    from driver.preflight import hub_problems, term_problems
    from tasks.rewards.term import build_scorer
    if problems := term_problems(f"reward.terms.{name}", term) or hub_problems(term_models(name, term)):
        raise SettingError(invalid(problems))
    from tasks.rewards import resolve
    if not term.needs_images():
        raise SettingError(f"--term {name}: {term.fn} scores the refiners' text, not images; jointrl score scores "
                          f"image terms. Nothing was started.")
    if term.takes() == "clips":
        raise SettingError(f"--term {name}: {term.fn} scores clips, not images; jointrl score scores image terms. "
                          f"Nothing was started.")
    if not getattr(resolve(term.fn), "prompt_files", True):
        raise SettingError(f"--term {name}: {term.fn} scores its task's own prompt records, not prompts read from "
                          f"a file. Nothing was started.")
    prompts, files, sizes = checked_inputs(config, prompts_file, folder)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # a library's chatter must not mix into --json
            scorer = build_scorer(term, device, name)  # the image term itself: its `per_frame` picks frames of clips
    except ModelLoadError as e:
        raise SettingError(f"{e}. Nothing was scored.") from None
    except (ValueError, OSError) as e:
        raise SettingError(f"reward.terms.{name}: the term could not be built ({type(e).__name__}: {e}). "
                          f"Nothing was scored.") from None
    options = term.options()
    scores, strict = np.empty(len(files)), np.empty(len(files)) if getattr(scorer, "strict", None) else None
    for rows in chunks(sizes, getattr(options, "batch_size", CHUNK)):
        images = np.stack([from_uint8(read_image(f)) for f in files[rows]])
        batch = prompts[rows]
        try:
            scores[rows] = np.asarray(scorer(images, batch, [{}] * len(batch)), dtype=np.float64)
            if strict is not None:
                strict[rows] = np.asarray(scorer.strict(images, batch, [{}] * len(batch)), dtype=np.float64)
        except ValueError as e:  # a prompt the term cannot read (no quoted text, no GenEval metadata, …)
            raise SettingError(f"--prompts '{prompts_file}': reward.terms.{name} cannot score "
                              f"{', '.join(f.name for f in files[rows])}: {e}") from None
        progress(len(batch))
    return Scored(name, term.fn, files, prompts, scores, strict)


def table(scored: Scored, folder: Path, prompts_file: str, device) -> str:
    """The per-image scores with their files and prompts, then the mean, for a person to read."""
    width = max(len("image"), *(len(f.name) for f in scored.files))
    head = f"  {'image':<{width}}  {'score':>10}" + ("  strict" if scored.strict is not None else "") + "  prompt"
    lines = [f"jointrl score: {scored.term} (fn {scored.fn}) on {len(scored.files)} images of {folder}, "
             f"prompts from {prompts_file}, on {device}", head]
    for i, (f, s, p) in enumerate(zip(scored.files, scored.scores, scored.prompts)):
        text = p.text if len(p.text) <= 60 else p.text[:57] + "..."
        mark = f"  {int(scored.strict[i]):>6}" if scored.strict is not None else ""
        lines.append(f"  {f.name:<{width}}  {s:>10.4f}{mark}  {text}")
    mean, bad = scored.mean(), int((~np.isfinite(scored.scores)).sum())
    summary = f"  mean {mean:.4f} over {len(scored.files) - bad} images" if mean is not None else "  no finite score"
    summary += f" ({bad} not finite: left out)" if bad else ""
    if scored.strict is not None:
        summary += f"; strict (all clauses hold) {scored.strict.mean():.3f}"
    return "\n".join([*lines, summary])


def run_score(args) -> int:
    import torch
    from tqdm import tqdm
    config, term = term_config(args.config, args.overrides, args.term)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = Path(args.images)
    with tqdm(desc="jointrl score", unit="image", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        try:
            scored = score_folder(config, args.term, term, args.prompts, folder=folder, device=device,
                                  progress=bar.update)
        except (SettingError, KeyboardInterrupt):
            raise
        except Exception as e:  # the term's own failure (a model error, out of memory): one line, not a trace
            print(f"jointrl score: reward.terms.{args.term} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    print(json.dumps(scored.as_json()) if args.json else table(scored, folder, args.prompts, device), flush=True)
    return 0
