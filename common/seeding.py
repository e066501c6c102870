"""Every random draw in a run comes from a seed derived here from the config's seed and a label."""
from __future__ import annotations

import zlib

import torch


def derive_seed(*parts) -> int:
    """A stable 63-bit seed for `parts` (e.g. run seed, "noise", step, sample): same parts, same seed."""
    return zlib.crc32("/".join(map(str, parts)).encode()) * 2654435761 % (2 ** 63)


def generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))
