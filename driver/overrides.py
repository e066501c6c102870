"""`--set dotted.key=value`: a value parsed as YAML, written into the config tree before validation.

Setting a key only builds the tree (`experts.refiners.0.lr` grows the list as needed); whether the
key exists and the value fits is the schema's to say, so every error names the key the same way.
"""
from __future__ import annotations

import re

import yaml

from common.config import SettingError


def parse_override(item: str) -> tuple[str, object]:
    """`key=value` as (key, value), the value read as YAML (`3`, `true`, `[a, b]`, `{r: 4}`)."""
    if "=" not in item:
        raise SettingError(f"invalid --set '{item}': expected dotted.key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def set_key(tree: dict, dotted: str, value) -> None:
    """Write `value` at `dotted` in `tree`, making the sections (and list items) on the way."""
    keys = dotted.split(".")
    node = tree
    for i, k in enumerate(keys[:-1]):
        if isinstance(node, list) and k.isdigit():
            k = int(k)
            node += [{} for _ in range(k + 1 - len(node))]
        elif not isinstance(node, dict):
            raise SettingError(f"invalid config key '{dotted}': '{'.'.join(keys[:i])}' is not a section")
        nxt = node[k] if (isinstance(node, list) or k in node) else None
        if nxt is None:
            nxt = node[k] = {}
        node = nxt
    if isinstance(node, list):
        raise SettingError(f"invalid config key '{dotted}': give a field, e.g. '{dotted}.lr'")
    if not isinstance(node, dict):
        raise SettingError(f"invalid config key '{dotted}': '{'.'.join(keys[:-1])}' is a value, not a section")
    node[keys[-1]] = value


def apply(tree: dict, overrides: list[str]) -> dict:
    """`tree` with every `dotted.key=value` of `overrides` set, in order."""
    for item in overrides:
        set_key(tree, *parse_override(item))
    return tree


def first_refiners(tree: dict, overrides: list[str]) -> dict:
    """`tree` (a preset's or file's) without its refiner sections beyond the number
    `--set experts.n_refiners=K` asks for: a preset describes the refiners it has, and K of them
    are its first K. A section an override names beyond K stays, for the schema to refuse."""
    asked = [value for key, value in map(parse_override, overrides) if key == "experts.n_refiners"]
    n, experts = asked[-1] if asked else None, tree.get("experts")
    if type(n) is not int or n < 1 or not isinstance(experts, dict):
        return tree  # not asked, or a value the schema refuses
    kept = {k: v for k, v in experts.items() if not ((m := re.fullmatch(r"refiner_(\d+)", k)) and int(m[1]) >= n)}
    if isinstance(kept.get("refiners"), list):
        kept["refiners"] = kept["refiners"][:n]
    return {**tree, "experts": kept}


def merge(base: dict, top: dict) -> dict:
    """`base` with every key of `top` set on it, section by section (a section in both is merged)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def flat(tree, prefix: str = "") -> dict:
    """A nested config dump as {dotted.key: value}, list items by index (`experts.refiners.0.lr`)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        return {prefix.rstrip("."): tree}
    return {k: v for key, value in items for k, v in flat(value, f"{prefix}{key}.").items()}
