"""Which device an actor's models live on: the GPU Ray gave it, if its resources asked for one
(Ray sets CUDA_VISIBLE_DEVICES, so it is `cuda`), else the CPU. Tensors cross actors on the CPU
(the object store holds numpy arrays) and move to the device where they are used."""
from __future__ import annotations

import torch


def actor_device(resources) -> torch.device:
    return torch.device("cuda") if resources.num_gpus > 0 and torch.cuda.is_available() else torch.device("cpu")


def local_device() -> torch.device:
    """Where a command that runs in its own process (`jointrl eval`, `sample`, `report`) puts its
    models: this machine's first GPU if it has one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def to_device(tree, device: torch.device):
    """Every tensor in a nest of dicts and lists, on `device` (anything else as it is)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_device(v, device) for v in tree]
    return tree
