"""Where a run's config tree starts: a named preset (a YAML file in the `configs` package) or a YAML path.

Presets are files rather than code so that `jointrl config show --config NAME` and the file say the
same thing, and a copied preset is a ready starting point for a custom config. They are found with
importlib.resources, so an installed package finds them too.
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import yaml

from common.config import SettingError


def names() -> list[str]:
    """The preset names, e.g. `shapes`, `shapes-tiny`."""
    return sorted(p.name.removesuffix(".yaml") for p in files("configs").iterdir() if p.name.endswith(".yaml"))


def load_tree(source: str) -> dict:
    """The config tree of a preset name or YAML path (a fresh dict: overrides may change it)."""
    if source in names():
        where, folder = f"preset '{source}'", files("configs")
        text = folder.joinpath(f"{source}.yaml").read_text()
    elif Path(source).is_file():
        where, folder, text = f"config file '{source}'", Path(source).resolve().parent, Path(source).read_text()
    else:
        raise SettingError(f"unknown config '{source}': neither a preset ({', '.join(names())}) "
                          f"nor an existing YAML file")
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise SettingError(f"{where} is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise SettingError(f"{where} must hold a mapping of sections, not {type(tree).__name__}")
    return with_file_paths(tree, folder)


def with_file_paths(tree: dict, folder) -> dict:
    """`task.train`, `task.eval` and `experts.base` given relative to the config file's folder, as
    absolute paths (where such a file exists there), so the saved config names the same files
    from anywhere."""
    def placed(source):
        if not isinstance(source, str) or Path(source).is_absolute() or Path(source).exists():
            return source
        there = Path(str(folder.joinpath(source)))
        return str(there) if there.exists() else source
    experts = tree.get("experts")
    if isinstance(experts, dict) and "base" in experts:
        tree = {**tree, "experts": {**experts, "base": placed(experts["base"])}}
    task = tree.get("task")
    if not isinstance(task, dict):
        return tree
    task = dict(task)
    if "train" in task:
        task["train"] = placed(task["train"])
    if isinstance(task.get("eval"), dict):
        task["eval"] = {name: placed(src) for name, src in task["eval"].items()}
    elif "eval" in task:
        task["eval"] = placed(task["eval"])
    return {**tree, "task": task}
