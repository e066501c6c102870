"""Where a run's config tree starts: a named preset (a YAML file in the `configs` package) or a YAML path.

Presets are files rather than code so that `jointrl config show --config NAME` and the file say the
same thing, and a copied preset is a ready starting point for a custom config. They are found with
importlib.resources, so an installed package finds them too.
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import yaml

from driver.config import ConfigError


def names() -> list[str]:
    """The preset names, e.g. `shapes`, `shapes-tiny`."""
    return sorted(p.name.removesuffix(".yaml") for p in files("configs").iterdir() if p.name.endswith(".yaml"))


def load_tree(source: str) -> dict:
    """The config tree of a preset name or YAML path (a fresh dict: overrides may change it)."""
    if source in names():
        where, text = f"preset '{source}'", files("configs").joinpath(f"{source}.yaml").read_text()
    elif Path(source).is_file():
        where, text = f"config file '{source}'", Path(source).read_text()
    else:
        raise ConfigError(f"unknown config '{source}': neither a preset ({', '.join(names())}) "
                          f"nor an existing YAML file")
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{where} must hold a mapping of sections, not {type(tree).__name__}")
    return tree
