"""Checkpoints: per expert its weights, optimizer state and version, plus the driver's step.

Written into a temporary folder and renamed into place, so a checkpoint is whole or absent. Loaded
with `torch.load(weights_only=True)`: no pickle of arbitrary objects.
"""
from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch


@contextmanager
def atomic_dir(final: Path):
    """Yield a temporary folder beside `final`; once the block succeeds it replaces `final`."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def save(run_dir: Path, step: int, states: dict[str, dict]) -> Path:
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    with atomic_dir(final) as tmp:
        for eid, st in states.items():
            torch.save({"version": st["version"], "last_step": st["last_step"],
                        "weights": {k: torch.tensor(np.asarray(v)) for k, v in st["weights"].items()},
                        "optimizer": st["optimizer"]}, tmp / f"{eid}.pt")
        (tmp / "manifest.json").write_text(json.dumps(
            {"step": step, "versions": {e: s["version"] for e, s in states.items()}}, indent=1))
    return final
