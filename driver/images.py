"""Image grids as PNG files, with no imaging library: users look at samples rather than read them."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from tasks.base import to_uint8


def strip(tile: np.ndarray) -> np.ndarray:
    """A uint8 image (H, W, 3) as it is; a clip (F, H, W, 3) as its frames side by side."""
    return np.concatenate(list(tile), axis=1) if tile.ndim == 4 else tile


def grid(images: np.ndarray, cols: int = 8, pad: int = 2, scale: int = 4) -> np.ndarray:
    """Generator images (B, 3, H, W) or clips (B, F, 3, H, W) in [-1, 1] tiled into one uint8 (rows,
    cols) picture, enlarged (a clip as its frames side by side)."""
    tiles = [strip(to_uint8(im)) for im in images]
    h, w = tiles[0].shape[:2]
    rows = -(-len(tiles) // cols)
    out = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 60, np.uint8)
    for i, tile in enumerate(tiles):
        r, c = divmod(i, cols)
        out[pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = tile
    return out.repeat(scale, 0).repeat(scale, 1)


def write_png(path: Path, rgb: np.ndarray) -> Path:
    """An 8-bit RGB PNG of `rgb` (H, W, 3)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    return Path(path)
