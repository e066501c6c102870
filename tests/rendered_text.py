"""Phrases rendered with PIL as generator images, for the tests that read text with real OCR weights."""
from __future__ import annotations

from pathlib import Path

import numpy as np

PHRASES = ["OPEN 24 HOURS", "Hello World", "SPRING SALE", "Fresh Coffee", "NASA 2049", "Night Market"]
# (font size in px, where, background) for each phrase in turn: small to large, corners to centre
LAYOUTS = [(22, ("left", "top"), "plain"), (40, ("centre", "middle"), "busy"), (56, ("right", "bottom"), "plain"),
           (30, ("left", "bottom"), "busy"), (34, ("centre", "top"), "plain"), (48, ("right", "middle"), "busy")]
SIDE = 384


def busy_background(rng):
    """Forty random ellipses and rectangles of random colours over a random colour."""
    from PIL import Image, ImageDraw
    image = Image.new("RGB", (SIDE, SIDE), tuple(int(c) for c in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x, y = rng.integers(-SIDE // 4, SIDE, 2)
        w, h = rng.integers(SIDE // 16, SIDE // 2, 2)
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((int(x), int(y), int(x + w), int(y + h)), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return image


def rendered(text: str, size: int, where: tuple[str, str], background: str, rng) -> np.ndarray:
    """`text` in DejaVu Sans (matplotlib's copy, so every machine has it) as a generator image
    (3, SIDE, SIDE) in [-1, 1]: dark on a plain light background, or white outlined in black on a
    busy one."""
    import matplotlib
    from PIL import Image, ImageDraw, ImageFont
    font = ImageFont.truetype(str(Path(matplotlib.get_data_path()) / "fonts/ttf/DejaVuSans.ttf"), size)
    image = busy_background(rng) if background == "busy" else Image.new("RGB", (SIDE, SIDE), (235, 230, 220))
    draw = ImageDraw.Draw(image)
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    x = {"left": 12, "centre": (SIDE - (x1 - x0)) // 2, "right": SIDE - (x1 - x0) - 12}[where[0]]
    y = {"top": 12, "middle": (SIDE - (y1 - y0)) // 2, "bottom": SIDE - (y1 - y0) - 20}[where[1]]
    if background == "busy":
        draw.text((x, y), text, font=font, fill="white", stroke_width=max(2, size // 12), stroke_fill="black")
    else:
        draw.text((x, y), text, font=font, fill=(20, 20, 20))
    return np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1
