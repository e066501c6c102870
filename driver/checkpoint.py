"""Checkpoints: per expert its weights, optimizer state and version, plus the driver's step.

Written into a temporary folder and renamed into place, so a checkpoint is whole or absent. Loaded
with `torch.load(weights_only=True)`: no pickle of arbitrary objects.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch


def save(run_dir: Path, step: int, states: dict[str, dict]) -> Path:
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for eid, st in states.items():
        torch.save({"version": st["version"], "last_step": st["last_step"],
                    "weights": {k: torch.tensor(np.asarray(v)) for k, v in st["weights"].items()},
                    "optimizer": st["optimizer"]}, tmp / f"{eid}.pt")
    (tmp / "manifest.json").write_text(json.dumps(
        {"step": step, "versions": {e: s["version"] for e, s in states.items()}}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final
