"""An expert's weights in the form they travel in and are stored in.

A version is the tensors `synced_state` names: a LoRA adapter's alone (the base never changes),
else every weight. They travel as {name: numpy array}, which the object store hands out zero-copy,
and are fingerprinted and checkpointed in that form. numpy has no bfloat16, so a bfloat16 tensor
travels as its raw 16-bit words (`travel_form`) and is viewed back as bfloat16 by the receiving
model, which knows its own dtypes (`model_tensors`). A trainer keeps a low-precision model's
trained parameters in fp32 (experts/precision.py), and a version travels as it keeps them, so that
a snapshot restores it exactly; a rollout worker's copy, in the model's dtype, casts them on load.
"""
from __future__ import annotations

import copy
import warnings
import zlib

import numpy as np
import torch

from experts.precision import kept_dtype


def as_tensor(value) -> torch.Tensor:
    """A numpy array (read-only ones from the object store too) or a tensor, as a tensor, uncopied."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    with warnings.catch_warnings():  # read-only views are only read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(value))


def fingerprint(weights: dict) -> int:
    """A fast fingerprint of a weights dict (numpy arrays or tensors, on any device): every array's
    name, shape and dtype, and the sum of its bytes as 64-bit words (mod 2^64), mixed in name
    order. It catches truncated, missing or corrupted tensors at memory speed (about 5 ms per
    100 MB); it is not a cryptographic hash."""
    total = 0
    for name in sorted(weights):
        tensor = as_tensor(weights[name]).contiguous()
        if tensor.data_ptr() % 8:  # a view at an odd offset of a flat buffer: read as words from a copy
            tensor = tensor.clone()
        raw = tensor.reshape(-1).view(torch.uint8)
        whole = raw.numel() // 8 * 8
        words = int(raw[:whole].view(torch.int64).sum()) % (1 << 64) + int(raw[whole:].sum())
        dtype = str(tensor.dtype).removeprefix("torch.")
        label = zlib.crc32(f"{name}{tuple(tensor.shape)}{dtype}".encode())
        total = (total * 1_000_003 + label + words) % (1 << 64)
    return total


def synced_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a new version of `model` consists of."""
    return model.synced_state() if hasattr(model, "synced_state") else model.state_dict()


def is_lora(model) -> bool:
    return bool(getattr(model, "lora", False))


def travel_form(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as they travel: bfloat16 viewed as int16 words (no copy), the rest as they are."""
    return {k: (v.detach().view(torch.int16) if v.dtype == torch.bfloat16 else v.detach()) for k, v in tensors.items()}


def to_arrays(model: torch.nn.Module, private: bool = False) -> dict[str, np.ndarray]:
    """The model's version as numpy arrays: views of its tensors on the CPU (Ray copies them into
    the object store as an actor method returns), private copies if `private` (in-process, where a
    later update would change a snapshot already taken)."""
    return arrays_of(synced_state(model), private)


def arrays_of(tensors: dict[str, torch.Tensor], private: bool = False) -> dict[str, np.ndarray]:
    """A version's tensors as numpy arrays, as `to_arrays` gives them."""
    arrays = {k: v.cpu().numpy() for k, v in travel_form(tensors).items()}
    return {k: v.copy() for k, v in arrays.items()} if private else arrays


def optimizer_arrays(state: dict, private: bool = False) -> dict:
    """An optimizer state_dict as it leaves an actor: every tensor of its per-parameter state a
    numpy array on the host, in `travel_form` (the object store hands numpy out zero-copy, and a
    receiver without the sender's device, a CPU-only head, never deserializes a device tensor),
    with the keys of the bfloat16 ones listed under "bfloat16" ("<param>.<key>"); the rest as it is.
    Views of a CPU optimizer's tensors (Ray copies them as the method returns), or private copies
    if `private` (in-process, where the next step would change them)."""
    arrays, bfloat16 = {}, []
    for pid, entries in state["state"].items():
        arrays[pid] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                bfloat16 += [f"{pid}.{key}"] if value.dtype == torch.bfloat16 else []
                value = travel_form({key: value})[key].cpu().numpy()
            arrays[pid][key] = copy.deepcopy(value) if private else value
    groups = copy.deepcopy(state["param_groups"]) if private else state["param_groups"]
    return {"state": arrays, "param_groups": groups, "bfloat16": bfloat16}


def optimizer_tensors(state: dict | None) -> dict | None:
    """An `optimizer_arrays` state as the state_dict `load_state_dict` takes: its arrays as CPU
    tensors of their own (the object store's are read-only), bfloat16 ones viewed back from their
    words. A state_dict of tensors (a checkpoint's) passes as it is."""
    if state is None or "bfloat16" not in state:
        return state
    bfloat16 = set(state["bfloat16"])

    def tensor(name: str, value):
        if not isinstance(value, np.ndarray):
            return value
        out = torch.from_numpy(np.array(value))  # a copy, of any shape (a 0-d step count too)
        return out.view(torch.bfloat16) if name in bfloat16 else out
    return {"state": {pid: {key: tensor(f"{pid}.{key}", v) for key, v in entries.items()}
                      for pid, entries in state["state"].items()},
            "param_groups": state["param_groups"]}


def model_tensors(model: torch.nn.Module, weights: dict, share: bool = False) -> dict[str, torch.Tensor]:
    """Travelled `weights` as the tensors `model` holds (its dtypes and device: a trainer's fp32
    cast to a worker's bfloat16, rounded to nearest, on the worker's device). `share`: read them in place (read-only
    views) where they already are what the model needs, else copies."""
    own = synced_state(model)
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise ValueError(f"weights for {unknown[:3]}{'…' if len(unknown) > 3 else ''}, which the model does not have")
    out = {}
    for name, value in weights.items():
        tensor = as_tensor(value)
        if own[name].dtype == torch.bfloat16 and tensor.dtype == torch.int16:
            tensor = tensor.view(torch.bfloat16)
        # a model whose weights an inference engine holds (experts/vllm_refiner.py) names them on the
        # meta device: they stay where they arrived (the host, or the device a broadcast filled)
        device = own[name].device if own[name].device.type != "meta" else tensor.device
        # moved first, then cast: a blocking host-to-GPU copy that also changes the dtype converts on
        # the host (torch's copy_kernel_cuda), one thread for a whole version; on the GPU it is quick
        moved = tensor.to(device)
        out[name] = moved.to(own[name].dtype, copy=not share and moved is tensor)  # one copy at most
    return out


def travelled(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Empty (meta-device) tensors of the shapes and dtypes of `model`'s version as its trainer sends
    it (`travel_form` of its tensors as the trainer keeps them: fp32 where it trains a parameter of
    a low-precision model): what a copy of the model in another process receives a broadcast into."""
    kept = {name: kept_dtype(p) for name, p in model.named_parameters(remove_duplicate=False)}
    out = {}
    for name, tensor in synced_state(model).items():
        dtype = kept.get(name, tensor.dtype)
        out[name] = torch.empty(tensor.shape, dtype=torch.int16 if dtype == torch.bfloat16 else dtype, device="meta")
    return out


def load(model: torch.nn.Module, tensors: dict[str, torch.Tensor], assign: bool = False) -> None:
    """Make `tensors` (a whole version) the model's: assigned in place of its own (`assign`, for
    inference copies that read shared weights) or copied into them."""
    missing = sorted(set(synced_state(model)) - set(tensors))
    if missing:
        raise ValueError(f"a version without {missing[:3]}{'…' if len(missing) > 3 else ''}")
    model.load_state_dict(tensors, strict=not is_lora(model), assign=assign)


class AdapterOff:
    """The frozen reference of a LoRA model: the model itself with its adapter disabled."""

    def __init__(self, model):
        self.model = model

    def token_logprobs(self, *args):
        with torch.no_grad(), self.model.adapter_disabled():
            return self.model.token_logprobs(*args)

    def __call__(self, *args, **kwargs):
        with torch.no_grad(), self.model.adapter_disabled():
            return self.model(*args, **kwargs)


def reference_of(model: torch.nn.Module):
    """The frozen reference the KL is taken against: the base under a LoRA adapter (no second
    copy of the weights), else a frozen copy of the model as it starts."""
    return AdapterOff(model) if is_lora(model) else copy.deepcopy(model).requires_grad_(False).eval()
