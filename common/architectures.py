"""Where a model's config files are: what `jointrl plan` (experts/memory.py) builds on the meta device
and what a `random:<name>` model (common/random_models.py) is built from.

A model named in a config is found, in order: `tiny:<kind>` as built locally; `random:<name>` as
`<name>` (the same architecture with random weights: it is planned exactly as the real one); a
local folder; the local Hugging Face cache, if it holds the model's config files; the copies
shipped in configs/architectures/<org>/<name> (their sources in the README there), so the presets'
real models are known without the hub. Nothing here goes to the network.
"""
from __future__ import annotations

import json
from pathlib import Path

from common.tiny import RANDOM, is_random, is_tiny, tiny_model

ARCHITECTURES = Path(__file__).resolve().parents[1] / "configs" / "architectures"


class UnknownModel(ValueError):
    """A model whose config files are neither in a local folder, the Hugging Face cache nor the
    shipped architectures."""


def config_folder(path: str, revision: str | None = None) -> Path:
    """The folder holding `path`'s config files (see the module docstring for the order)."""
    if is_tiny(path):
        return Path(tiny_model(path))
    if is_random(path):
        return config_folder(path[len(RANDOM):], revision)
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file() and not (local / "model_index.json").is_file():
            raise UnknownModel(f"'{path}' is a folder without config.json or model_index.json: not a saved model")
        return local
    if path.count("/") == 1 and not path.startswith((".", "/", "~")):
        cached = hub_cache_folder(path, revision)
        if cached is not None:
            return cached
        shipped = ARCHITECTURES / path
        if shipped.is_dir():
            return shipped
    raise UnknownModel(f"no config files for '{path}': not a local model folder, not in the Hugging Face cache "
                       f"and not among the architectures shipped in {ARCHITECTURES} "
                       f"({', '.join(shipped_models())}); download it first (huggingface-cli download {path} "
                       f"--include '*.json') or point the key at a local folder")


def hub_cache_folder(repo: str, revision: str | None) -> Path | None:
    """The snapshot folder of `repo` in the local Hugging Face cache, if it holds the model's
    config files (every component's, for a pipeline); never goes to the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for name in ("model_index.json", "config.json"):
        found = try_to_load_from_cache(repo, name, revision=revision)
        if isinstance(found, str):
            folder = Path(found).parent
            if name == "config.json" or all((folder / part / "config.json").is_file()
                                            for part in weighted_components(folder)):
                return folder
    return None


def shipped_models() -> list[str]:
    return sorted(str(p.parent.relative_to(ARCHITECTURES)) for p in ARCHITECTURES.glob("*/*/*.json")
                  if p.name in ("config.json", "model_index.json"))


def weighted_components(folder: Path) -> dict[str, tuple[str, str]]:
    """A pipeline's components that hold weights: name -> (library, class)."""
    index = model_index(folder)
    return {name: tuple(spec) for name, spec in index.items()
            if isinstance(spec, list) and spec[0] in ("diffusers", "transformers")
            and not name.startswith(("tokenizer", "scheduler", "processor", "feature_extractor"))}


def model_index(folder: Path) -> dict:
    """A pipeline's model_index.json, read as diffusers' `DiffusionPipeline.load_config` reads it
    (without importing diffusers)."""
    return json.loads((folder / "model_index.json").read_text())


def index_class(folder: Path) -> str:
    """The pipeline class a model_index.json names (its family)."""
    return model_index(folder).get("_class_name", "?")
