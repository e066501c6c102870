"""Models built on this machine instead of read from a folder or the hub: their names and the
builds of the tiny ones.

`tiny:<kind>` is a tiny random model of a real architecture (Qwen2, SD3, CLIP, OWLv2, TrOCR,
Qwen2-VL, …), built in-process by a seeded builder and saved once in the `transformers`/`diffusers`
layout under a cache folder; it is then loaded by the very code a real checkpoint goes through. So
tests and the `prompts-tiny` preset need no hub, and a run with real models differs only in names.
The cache is `$JOINTRL_TINY_CACHE`, else `~/.cache/jointrl/tiny`; builds are atomic (a folder is
renamed into place), so actors that ask at once all end up reading the same files.

`random:<name>` is the real architecture of `<name>` (a hub id whose config files are at hand, as
`jointrl plan` finds them, or a local folder of config files) with random weights and stand-in
tokenizers, built here (common/random_models.py) into `<cache>/random/` and loaded by the same code
as the real checkpoint: a run at real scale, planned as the real one, on a machine without the hub.
"""
from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path

TINY = "tiny:"
RANDOM = "random:"
# kind -> builder `package.module:function(out_dir) -> out_dir`; bump a kind's suffix when its builder changes
BUILDERS = {
    "qwen2": "experts.tiny_hf:tiny_text_lm",
    "qwen2_engine": "experts.tiny_hf:tiny_engine_lm",
    "sd3": "experts.tiny_hf:tiny_text_sd3",
    "flux1": "experts.tiny.flux1:tiny_flux1",
    "flux2_klein": "experts.tiny.flux2:tiny_flux2_klein",
    "qwen_image": "experts.tiny.qwen_image:tiny_qwen_image",
    "wan2.1": "experts.tiny.wan:tiny_wan21",
    "wan2.2_a14b": "experts.tiny.wan:tiny_wan22_a14b",
    "wan2.2_ti2v": "experts.tiny.wan:tiny_wan22_ti2v",
    "clip": "tasks.rewards.tiny.clip:tiny_clip",
    "aesthetic": "tasks.rewards.tiny.clip:tiny_aesthetic",
    "owlv2": "tasks.rewards.tiny.detector:tiny_owlv2",
    "grounding_dino": "tasks.rewards.tiny.detector:tiny_grounding_dino",
    "trocr": "tasks.rewards.tiny.ocr:tiny_trocr",
    "qwen2_vl": "tasks.rewards.tiny.vqa:tiny_qwen2_vl",
    "qwen2_5_vl": "tasks.rewards.tiny.vqa:tiny_qwen2_5_vl",
}
VERSION = "v1"


def is_tiny(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(TINY)


def is_random(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(RANDOM)


def built_here(spec: str | None) -> bool:
    """A model built on this machine rather than read from a folder or the hub (`tiny:`, `random:`)."""
    return is_tiny(spec) or is_random(spec)


def cache_root() -> Path:
    return Path(os.environ.get("JOINTRL_TINY_CACHE") or Path.home() / ".cache" / "jointrl" / "tiny")


def tiny_model(spec: str) -> str:
    """The folder of the tiny random model `tiny:<kind>`, built first if not cached."""
    kind = spec[len(TINY):]
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny model '{spec}'; there are {[TINY + k for k in BUILDERS]}")
    out = cache_root() / f"{kind}-{VERSION}"
    if not out.is_dir():
        module, _, name = BUILDERS[kind].partition(":")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=out.parent))
        try:
            getattr(importlib.import_module(module), name)(tmp)
            os.rename(tmp, out)
        except OSError:
            if not out.is_dir():  # not someone else's build that got there first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
