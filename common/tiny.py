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

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

TINY = "tiny:"
RANDOM = "random:"
# kind -> builder(out_dir): registered by the packages that own the models (`register_tiny`): the
# generator families and LMs by experts/ (experts/tiny/), the reward models by tasks/rewards/tiny/
BUILDERS: dict[str, Callable[[Path], object]] = {}
VERSION = "v1"  # bump it when a builder changes: every tiny model is built anew


def register_tiny(kind: str):
    """A decorator: the function builds `tiny:<kind>` into the folder it is given."""
    def registered(builder):
        BUILDERS[kind] = builder
        return builder
    return registered


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
        raise ValueError(f"unknown tiny model '{spec}'; there are {[TINY + k for k in BUILDERS]} (registered by "
                         f"experts/tiny/ and tasks/rewards/tiny/ as their packages are imported)")
    out = cache_root() / f"{kind}-{VERSION}"
    if not out.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=out.parent))
        try:
            BUILDERS[kind](tmp)
            os.rename(tmp, out)
        except OSError:
            if not out.is_dir():  # not someone else's build that got there first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
