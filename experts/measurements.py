"""Measurements of a model's memory, kept so that a model is traced once, not at every `jointrl plan`.

Tracing a real architecture on the meta device (experts/memory.py) takes seconds per model, most of
them importing diffusers, transformers and peft. What it measures depends only on the model's
config files, the arguments it is measured at (dtype, adapter, image size, ...) and the code that
traces it, so a measurement is kept under the sha256 of those three (`key`) and read back while
they stay the same. Two stores are looked up, in order:

- the measurements shipped beside the presets' architectures (configs/architectures/measured.json,
  written by `python bench/measured_architectures.py`; a test retraces each and compares);
- this machine's, one file per key under `<jointrl cache>/measured/` (common/tiny.py `cache_root`),
  written by the first plan that traces a model not shipped. A file that cannot be read is traced
  again and rewritten.

The libraries' versions a measurement ran under are recorded beside it rather than keyed (a key
that changed with every release of diffusers would make every plan trace again): where they differ
from the installed ones, `version_notes` says so, and JOINTRL_REMEASURE=1 traces every model again
(and keeps the new measurements in this machine's store).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Callable, TypeVar

from pydantic import TypeAdapter

from common.tiny import cache_root

SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "architectures" / "measured.json"
LIBRARIES = ("torch", "diffusers", "transformers", "peft")
# a config folder's files that describe the architecture (tokenizers and weight indexes do not)
CONFIG_FILES = ("model_index.json", "config.json", "*/config.json")

Record = TypeVar("Record")
_shipped: dict | None = None
used: dict[str, dict] = {}  # key -> entry, every measurement this process looked up or traced


def library_versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def source_file(module: str) -> Path:
    """The file of `module`, found without importing it."""
    spec = find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(module)
    return Path(spec.origin)


def key(kind: str, folder: Path, inputs: dict, modules: list[str]) -> str:
    """The sha256 of what a measurement depends on: its kind, the architecture's config files in
    `folder`, the `inputs` it is measured at (JSON) and the source of the `modules` that trace it."""
    h = hashlib.sha256(json.dumps({"kind": kind, "inputs": inputs}, sort_keys=True).encode())
    for name in sorted({p.relative_to(folder).as_posix() for pattern in CONFIG_FILES for p in folder.glob(pattern)}):
        h.update(f"\0file {name}\0".encode() + (folder / name).read_bytes())
    for module in sorted(modules):
        h.update(f"\0module {module}\0".encode() + source_file(module).read_bytes())
    return h.hexdigest()


def local_store() -> Path:
    return cache_root() / "measured"


def shipped() -> dict:
    global _shipped
    if _shipped is None:
        _shipped = json.loads(SHIPPED.read_text()) if SHIPPED.is_file() else {}
    return _shipped


def _local_entry(k: str) -> dict | None:
    try:
        entry = json.loads((local_store() / f"{k}.json").read_text())
        return entry if isinstance(entry, dict) and "value" in entry else None
    except (OSError, ValueError):
        return None


def _keep_locally(k: str, entry: dict) -> None:
    """Atomically (renamed into place); a store that cannot be written only costs the next plan a trace."""
    folder = local_store()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
            json.dump(entry, f, indent=1)
        os.replace(f.name, folder / f"{k}.json")
    except OSError:
        pass


def remembered(kind: str, record: type[Record], *, folder: Path, inputs: dict, modules: list[str],
               what: str, trace: Callable[[], Record]) -> Record:
    """The measurement of `kind` for the model in `folder` at `inputs`: read from a store if one
    holds it (and JOINTRL_REMEASURE is not set), else `trace()`d and kept in this machine's store.
    `what` names the model and inputs for a reader of the stores."""
    adapter = TypeAdapter(record)
    k = key(kind, folder, inputs, modules)
    entry = None if os.environ.get("JOINTRL_REMEASURE") else shipped().get(k) or _local_entry(k)
    if entry is not None:
        try:
            value = adapter.validate_python(entry["value"])
        except ValueError:  # a record of another shape: traced again
            entry = None
    if entry is None:
        value = trace()
        entry = {"what": what, "kind": kind, "versions": library_versions(),
                 "value": adapter.dump_python(value, mode="json")}
        _keep_locally(k, entry)
    used[k] = entry
    return value


def version_notes() -> list[str]:
    """One line per measurement used in this process that ran under other library versions than
    the installed ones."""
    installed = library_versions()
    notes = []
    for entry in used.values():
        differ = {n: v for n, v in entry.get("versions", {}).items() if installed.get(n) != v}
        if differ:
            notes.append(f"{entry['what']}: measured under "
                         f"{', '.join(f'{n} {v} (installed {installed.get(n)})' for n, v in differ.items())}; "
                         f"JOINTRL_REMEASURE=1 traces it again")
    return notes
