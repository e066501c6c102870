"""Checks of the outside world a valid config names, run before anything starts.

The schema (driver/config.py, experts/spec.py …) only judges values; whether the files, models,
packages and reward function they name exist is asked here, once, so that `jointrl config show`
works anywhere and a run still fails in one paragraph naming the key instead of minutes later.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from driver.config import ConfigError, invalid
from tasks.reward_guard import resolve

if TYPE_CHECKING:
    from driver.config import Config

# a model kind -> the packages it needs
KIND_PACKAGES = {"hf_causal_lm": ("transformers", "peft"), "diffusers_flow": ("diffusers", "transformers", "peft")}
# a logging flag -> the package it needs
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def weights_file(path: str) -> None:
    """An expert's weights: an existing safetensors file (weights are never unpickled)."""
    if not Path(path).is_file():
        raise ValueError(f"no checkpoint file at '{path}'")
    try:
        with safe_open(path, "pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types for every kind of bad header
        raise ValueError(f"'{path}' is not a safetensors weights file ({type(e).__name__}: {e}); "
                         f"weights are never loaded through pickle") from None


def model_path(path: str) -> str:
    """A local model directory (with its config.json) or a hub id (`org/name`, fetched when loaded);
    returns the path as it is loaded (a local one with `~` expanded)."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file() and not (local / "model_index.json").is_file():
            raise ValueError(f"'{path}' is a directory without config.json or model_index.json: not a saved model")
        return str(local)
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ValueError(f"no model directory at '{path}' (and it is not a hub id like 'org/name')")
    return path


def missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def preflight(config: Config) -> None:
    """Raise ConfigError naming every key whose file, model, package or reward function is not there.
    Local model paths are set to the directory that is loaded (`~` expanded)."""
    problems = []

    def check(key: str, test, *args):
        try:
            return test(*args)
        except ValueError as e:
            problems.append(f"{key}: {e}")

    for eid, spec in config.experts.sections().items():
        key = f"experts.{eid}"
        if spec.init is not None:
            check(f"{key}.init", weights_file, spec.init)
        if spec.model.kind in KIND_PACKAGES:
            if gone := missing(*KIND_PACKAGES[spec.model.kind]):
                problems.append(f"{key}.model.kind: needs {gone}: pip install 'jointrl[hf]'")
            if (path := check(f"{key}.model.path", model_path, spec.model.path)) is not None:
                spec.model.path = path
    if config.experts.text_encoder.init is not None:
        check("experts.text_encoder.init", weights_file, config.experts.text_encoder.init)
    if config.reward.fn is not None:
        check("reward.fn", resolve, config.reward.fn)  # importable and callable
    for flag, module in LOGGER_PACKAGES.items():
        if getattr(config.logging, flag) and missing(module):
            problems.append(f"logging.{flag}: true needs the '{module}' package: pip install 'jointrl[log]'")
    if problems:
        raise ConfigError(invalid(problems))
