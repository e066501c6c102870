"""Image grids as PNG files, with no imaging library, and clips as animations: users look at samples
rather than read them.

A clip (F, H, W, 3) uint8 is written as an animated GIF (Pillow, which matplotlib already needs:
always there) and, where `imageio[ffmpeg]` is installed (`pip install 'jointrl[video]'`, never
required), also as an MP4 beside it. GIF keeps 256 colours per frame and merges identical
consecutive frames into one longer frame (a still clip is one frame shown for the clip's length).
"""
from __future__ import annotations

import io
import importlib.util
import struct
import zlib
from pathlib import Path

import numpy as np

from tasks.base import to_uint8

FPS = 8  # frames per second of a written clip where the caller gives none


def grid(images: np.ndarray, cols: int = 8, pad: int = 2, scale: int = 4) -> np.ndarray:
    """Generator images (B, 3, H, W) in [-1, 1] tiled into one uint8 (rows, cols) picture, enlarged;
    clips (B, F, 3, H, W) into one clip of such pictures, (F, rows, cols, 3)."""
    return tiled(to_uint8(np.asarray(images)), cols, pad, scale)


def tiled(tiles: np.ndarray, cols: int = 8, pad: int = 2, scale: int = 4) -> np.ndarray:
    """`grid` of uint8 images (B, H, W, 3) or clips (B, F, H, W, 3)."""
    h, w = tiles.shape[-3:-1]
    rows = -(-len(tiles) // cols)
    out = np.full((*tiles.shape[1:-3], rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 60, np.uint8)
    for i, tile in enumerate(tiles):
        r, c = divmod(i, cols)
        out[..., pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w, :] = tile
    return out.repeat(scale, -3).repeat(scale, -2)


def write_png(path: Path, rgb: np.ndarray) -> Path:
    """An 8-bit RGB PNG of `rgb` (H, W, 3)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    return Path(path)


def gif_bytes(frames: np.ndarray, fps: float = FPS) -> bytes:
    """An animated GIF of `frames` (F, H, W, 3) uint8, looping, `fps` frames a second."""
    from PIL import Image
    # each frame's 256 colours by fast octree: Pillow's default median cut takes ~50x longer on a sheet
    pictures = [Image.fromarray(np.ascontiguousarray(f)).quantize(256, method=Image.Quantize.FASTOCTREE)
                for f in np.asarray(frames, dtype=np.uint8)]
    out = io.BytesIO()
    pictures[0].save(out, format="GIF", save_all=True, append_images=pictures[1:], loop=0,
                     duration=max(round(1000 / fps), 20))  # browsers play faster GIF frames at 10 fps
    return out.getvalue()


def can_write_mp4() -> bool:
    """Whether imageio and its ffmpeg are installed (`pip install 'jointrl[video]'`)."""
    return all(importlib.util.find_spec(m) is not None for m in ("imageio", "imageio_ffmpeg"))


def write_mp4(path: Path, frames: np.ndarray, fps: float = FPS) -> Path:
    """An H.264 MP4 of `frames` (F, H, W, 3) uint8, padded grey to sides of a multiple of 16 (what
    the encoder's yuv420p and most players take)."""
    import imageio.v2 as imageio
    frames = np.asarray(frames, dtype=np.uint8)
    h, w = frames.shape[1:3]
    frames = np.pad(frames, ((0, 0), (0, -h % 16), (0, -w % 16), (0, 0)), constant_values=60)
    imageio.mimwrite(str(path), list(frames), fps=fps, codec="libx264", quality=8, macro_block_size=16)
    return Path(path)


def write_clip(path: Path, frames: np.ndarray, fps: float = FPS) -> list[Path]:
    """`frames` (F, H, W, 3) uint8 as `path` with suffix .gif, and beside it .mp4 when imageio[ffmpeg]
    is installed; returns the files written, the GIF first."""
    gif = Path(path).with_suffix(".gif")
    gif.write_bytes(gif_bytes(frames, fps))
    return [gif, *([write_mp4(gif.with_suffix(".mp4"), frames, fps)] if can_write_mp4() else [])]


def write_picture(path: Path, picture: np.ndarray, fps: float = FPS) -> list[Path]:
    """A picture (H, W, 3) uint8 as the PNG `path`; a clip (F, H, W, 3) as `write_clip`."""
    picture = np.asarray(picture)
    if picture.ndim == 4:
        return write_clip(path, picture, fps)
    return [write_png(path, picture)]
