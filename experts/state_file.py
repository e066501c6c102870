"""One expert's state on disk: tensors in `<id>.safetensors`, the rest in `<id>.json`.

Safetensors holds the weights (`weights.<name>`) and the optimizer's tensors
(`optimizer.<param>.<key>`); JSON holds the version, the last applied step and the optimizer's
hyper-parameters. A sharded (fsdp) expert's optimizer tensors are instead in `<id>.optimizer/`,
one safetensors file per rank with each shard's offsets, as torch.distributed.checkpoint's
Hugging Face storage writes them; they are read back whole, for any number of ranks. Nothing is
ever loaded through pickle.

Files are written one tensor at a time from the memory the tensor already has, and hashed as they
are written (`write_safetensors`): safetensors' own `save_file` first serialises every tensor into
a copy of the whole, which for a full fine-tune of a large model is tens of GB more than the
snapshot itself, and a sha256 computed afterwards would read each file back.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from experts.records import ExpertInfo, ShardFiles, Snapshot

SHARDS = ".optimizer"  # the folder of a sharded expert's optimizer state: <id>.optimizer/
CHUNK = 64 << 20  # bytes written (and hashed) at a time
# safetensors' dtype names (its format's specification), for the tensors' torch and numpy dtypes
TORCH_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
# the order in which safetensors lays tensors out (its Dtype enumeration, largest first): every
# tensor starts aligned, and a file is byte for byte what its own writer writes
LAYOUT = ["U64", "I64", "F64", "U32", "F32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8",
          "BOOL"]
NUMPY_DTYPES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
                np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def write(folder: Path, expert_id: str, weights: dict, optimizer: dict | ShardFiles | None = None,
          *, info: ExpertInfo | None = None) -> dict[str, str]:
    """An expert's snapshot (`Expert.snapshot`): weights {name: array}, an optimizer state_dict (its
    tensors as they are, or as `optimizer_arrays` made them travel; or a sharded expert's ShardFiles)
    or None, and its ExpertInfo (a pretrained base has none). Returns {file, relative to `folder`:
    sha256} of every file of the expert's, a sharded optimizer's files included."""
    tensors = {f"weights.{k}": v for k, v in weights.items()}
    hashes = {}
    if isinstance(optimizer, ShardFiles):
        hashes.update(write_shard_files(folder, f"{expert_id}{SHARDS}", optimizer.files))
        optimizer = {"state": {}, "param_groups": optimizer.param_groups}
    optimizer = optimizer or {"state": {}, "param_groups": []}
    bfloat16 = set(optimizer.get("bfloat16", ()))  # travelled as 16-bit words (experts/weights.py)
    dtypes = {}
    for pid, entries in optimizer["state"].items():
        for key, value in entries.items():
            name = f"optimizer.{pid}.{key}"
            tensors[name] = value if isinstance(value, (np.ndarray, torch.Tensor)) else np.asarray(value)
            if f"{pid}.{key}" in bfloat16:
                dtypes[name] = "BF16"
    hashes[f"{expert_id}.safetensors"] = write_safetensors(folder / f"{expert_id}.safetensors", tensors, dtypes)
    info = info or ExpertInfo(0, -1)
    meta = json.dumps({"version": info.version, "last_step": info.last_step,
                       "param_groups": optimizer["param_groups"]}, indent=1).encode()
    (folder / f"{expert_id}.json").write_bytes(meta)
    hashes[f"{expert_id}.json"] = hashlib.sha256(meta).hexdigest()
    return hashes


def write_shard_files(folder: Path, shards: str, files: dict) -> dict[str, str]:
    """A sharded optimizer's files in `folder/shards/`, as its ranks handed them over
    (`Expert.optimizer_files`): {name: the sha256 of a file a rank wrote there itself, or its bytes
    to write}. Returns {shards/name: sha256}."""
    (folder / shards).mkdir(exist_ok=True)
    for left in (folder / shards).glob(".shards-*"):  # a rank's scratch, from a try it did not finish
        shutil.rmtree(left, ignore_errors=True)
    hashes = {}
    for name, held in files.items():
        path = folder / shards / name
        if isinstance(held, str):
            if not path.is_file():
                raise FileNotFoundError(f"'{path}': a rank said it wrote it there, and it is not there")
            hashes[f"{shards}/{name}"] = held
        else:
            hashes[f"{shards}/{name}"] = write_streamed(path, [memoryview(np.asarray(held)).cast("B")])
    return hashes


def write_safetensors(path: Path, tensors: dict, dtypes: dict[str, str] | None = None) -> str:
    """`tensors` ({name: numpy array or torch tensor on the CPU}) as a safetensors file at `path`,
    each written from its own memory (a non-contiguous one is made contiguous first); `dtypes`
    names the safetensors dtype of arrays that hold another type's bits (bfloat16 as int16 words).
    As safetensors' own writer does, the header is padded to 8 bytes and the tensors are laid out
    in LAYOUT's order of their dtypes, then by name. Returns the file's sha256."""
    dtypes = dtypes or {}
    raw = {name: raw_bytes(name, value) for name, value in tensors.items()}
    stored = {name: dtypes.get(name, held.dtype) for name, held in raw.items()}
    order = sorted(raw, key=lambda name: (LAYOUT.index(stored[name]), name))
    header, offset = {}, 0
    for name in order:
        held = raw[name]
        header[name] = {"dtype": stored[name], "shape": held.shape,
                        "data_offsets": [offset, offset + held.data.nbytes]}
        offset += held.data.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return write_streamed(path, [len(encoded).to_bytes(8, "little") + encoded, *(raw[name].data for name in order)])


class RawTensor(NamedTuple):
    """A tensor as safetensors stores it: its dtype's name, shape and bytes (a flat uint8 array)."""
    dtype: str
    shape: list[int]
    data: np.ndarray


def raw_bytes(name: str, value) -> RawTensor:
    """`value` (a numpy array or a CPU torch tensor) as safetensors stores it: a view of its memory
    where that is contiguous and little-endian already, else one copy of this tensor alone."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in TORCH_DTYPES:
            raise ValueError(f"cannot store '{name}': safetensors has no dtype {value.dtype}")
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return RawTensor(TORCH_DTYPES[value.dtype], list(value.shape), data)
    value = np.asarray(value, order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    little = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
    if little not in NUMPY_DTYPES:
        raise ValueError(f"cannot store '{name}': safetensors has no dtype {value.dtype}")
    data = value.astype(little, copy=False).reshape(-1).view(np.uint8)
    return RawTensor(NUMPY_DTYPES[little], list(value.shape), data)


def write_streamed(path: Path, pieces) -> str:
    """`pieces` (buffers) one after another into `path`, CHUNK bytes at a time, hashed as they are
    written: the file's sha256."""
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            for at in range(0, len(view), CHUNK):
                digest.update(view[at:at + CHUNK])
                out.write(view[at:at + CHUNK])
    return digest.hexdigest()


def sha256(path: Path) -> str:
    """A file's sha256, read CHUNK bytes at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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


def write_shards(optimizer: torch.optim.Optimizer, into: Path | None = None, scratch: str | None = None) -> dict:
    """This rank's shards of a sharded optimizer's tensors (`optimizer.<param>.<key>`), written with
    torch.distributed.checkpoint's Hugging Face storage (safetensors, each shard's offsets in its
    header; a collective: every rank of the expert calls it; each rank's files have names of their
    own). Into `into`, a checkpoint's folder of them that this process can reach: {file name: sha256}.
    Else into a temporary folder in `scratch` (None: the system's), handed over mapped from the file:
    {file name: its bytes as a numpy uint8 array}, which the object store copies from the page cache
    and this process's heap never holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    tensors = {f"optimizer.{pid}.{k}": v for pid, entries in optimizer.state_dict()["state"].items()
               for k, v in entries.items()}
    if into is not None:
        into.mkdir(parents=True, exist_ok=True)
    if scratch is not None:
        Path(scratch).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=into or scratch, prefix=".shards-") as tmp:
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(tmp, save_distributed=True))
        written = sorted(Path(tmp).iterdir())
        if into is None:  # a file mapped stays readable once its folder is removed
            return {p.name: np.asarray(np.memmap(p, dtype=np.uint8, mode="r")) for p in written}
        hashes = {}
        for p in written:
            hashes[p.name] = sha256(p)
            p.rename(into / p.name)
        return hashes


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
