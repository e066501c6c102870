"""Host memory for what a colocated rank does not use while it rolls out (`cluster.offload`).

Under `cluster.layout=colocated` a rank samples and then trains on one device. Its sampling never
reads the optimizer's moments or the frozen reference (the KL is taken in the update), so they
can wait in host memory while the rollout holds the device, and come back before the update reads
them: the same tensors, copied there and back, so the numbers do not change. Whatever already
lives on the host (AdamW's step counters, a CPU run's everything) stays where it is.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

HOST = torch.device("cpu")


def off_host(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type != HOST.type


@contextmanager
def on_host(optimizer: torch.optim.Optimizer, reference, parts: list[str]) -> Iterator[None]:
    """Within it, the optimizer state ("optimizer" in `parts`) and the frozen reference module
    ("reference"; under LoRA the reference is the model with its adapter off: nothing to move)
    are in host memory; after it, each tensor is back on the device it was on."""
    moved: list[tuple[dict, str, torch.device]] = []
    if "optimizer" in parts:
        for state in optimizer.state.values():
            for key, value in state.items():
                if off_host(value):
                    moved.append((state, key, value.device))
                    state[key] = value.to(HOST)
    reference_device = None
    if "reference" in parts and isinstance(reference, torch.nn.Module):
        first = next(reference.parameters(), None)
        if off_host(first):
            reference_device = first.device
            reference.to(HOST)
    try:
        yield
    finally:
        for state, key, device in moved:
            state[key] = state[key].to(device)
        if reference_device is not None:
            reference.to(reference_device)
