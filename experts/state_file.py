"""One expert's state on disk: tensors in `<id>.safetensors`, the rest in `<id>.json`.

Safetensors holds the weights (`weights.<name>`) and the optimizer's tensors
(`optimizer.<param>.<key>`); JSON holds the version, the last applied step and the optimizer's
hyper-parameters. A sharded (fsdp) expert's optimizer tensors are instead in `<id>.optimizer/`,
one safetensors file per rank with each shard's offsets, as torch.distributed.checkpoint's
Hugging Face storage writes them; they are read back whole, for any number of ranks. Nothing is
ever loaded through pickle.
"""
from __future__ import annotations

import errno
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from experts.records import ExpertInfo, ShardFiles, Snapshot
from experts.weights import optimizer_tensors

SHARDS = ".optimizer"  # the folder of a sharded expert's optimizer state: <id>.optimizer/


def write(folder: Path, expert_id: str, weights: dict, optimizer: dict | ShardFiles | None = None,
          info: ExpertInfo | None = None) -> None:
    """An expert's snapshot (`Expert.snapshot`): weights {name: array}, an optimizer state_dict (its
    tensors as they are, or as `optimizer_arrays` made them travel; or a sharded expert's ShardFiles)
    or None, and its ExpertInfo (a pretrained base has none)."""
    tensors = {f"weights.{k}": torch.tensor(np.asarray(v)).contiguous() for k, v in weights.items()}
    if isinstance(optimizer, ShardFiles):
        shards = folder / f"{expert_id}{SHARDS}"
        shards.mkdir()
        for name, data in optimizer.files.items():
            (shards / name).write_bytes(data)
        optimizer = {"state": {}, "param_groups": optimizer.param_groups}
    opt = optimizer_tensors(optimizer) or {"state": {}, "param_groups": []}
    for pid, entries in opt["state"].items():
        for key, value in entries.items():
            tensors[f"optimizer.{pid}.{key}"] = torch.as_tensor(value).clone().contiguous()
    path = folder / f"{expert_id}.safetensors"
    try:
        save_file(tensors, str(path))
    except SafetensorError as e:  # it reports a full disk in its own error type: say it as the OS does
        code = errno.ENOSPC if "No space left" in str(e) else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from e
    info = info or ExpertInfo(0, -1)
    meta = {"version": info.version, "last_step": info.last_step, "param_groups": opt["param_groups"]}
    (folder / f"{expert_id}.json").write_text(json.dumps(meta, indent=1))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise ValueError(f"cannot read '{path}' as safetensors: {e}") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Just the weights of an expert file (a run checkpoint's or a pretrained base's)."""
    return {k[len("weights."):]: v for k, v in read_tensors(Path(path)).items() if k.startswith("weights.")}


def read(folder: Path, expert_id: str) -> Snapshot:
    """The (weights, optimizer state_dict, info) that `write` wrote."""
    tensors = read_tensors(folder / f"{expert_id}.safetensors")
    meta = json.loads((folder / f"{expert_id}.json").read_text())
    if (folder / f"{expert_id}{SHARDS}").is_dir():
        tensors.update(read_shards(folder / f"{expert_id}{SHARDS}"))
    opt_state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("optimizer."):
            _, pid, key = k.split(".", 2)
            opt_state.setdefault(int(pid), {})[key] = v
    weights = {k[len("weights."):]: v.numpy() for k, v in tensors.items() if k.startswith("weights.")}
    optimizer = {"state": opt_state, "param_groups": meta["param_groups"]} if meta["param_groups"] else None
    return Snapshot(weights, optimizer, ExpertInfo(meta["version"], meta["last_step"]))


def write_shards(optimizer: torch.optim.Optimizer) -> dict[str, bytes]:
    """This rank's shards of a sharded optimizer's tensors (`optimizer.<param>.<key>`), written with
    torch.distributed.checkpoint's Hugging Face storage (safetensors, each shard's offsets in its
    header; a collective: every rank of the expert calls it): {file name: bytes}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    tensors = {f"optimizer.{pid}.{k}": v for pid, entries in optimizer.state_dict()["state"].items()
               for k, v in entries.items()}
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(tmp, save_distributed=True))
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())}


def read_shards(folder: Path) -> dict[str, torch.Tensor]:
    """The whole tensors of every rank's shards in `folder` (`write_shards`'), in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    try:
        meta = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
        whole = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()}
        with warnings.catch_warnings():  # that it reads in one process is what is meant here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(whole, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        raise ValueError(f"cannot read the optimizer shards in '{folder}': {e}") from None
    return whole
