"""Pictures of a run, drawn with matplotlib off-screen: curves of metrics over steps, and sheets of
sample images (or animated sheets of clips) captioned with their original and refined prompts."""
from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import numpy as np

from driver.images import FPS, write_clip


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed), imported only when drawing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(plt, fig, path: Path) -> Path:
    """Lay out `fig`, write it to `path` and free it; returns `path`. A character the font lacks
    (a refinement may hold any) is drawn as a box, without a warning for each."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout()
        fig.savefig(path)
    plt.close(fig)
    return path


def curves(rows: list[dict], keys: list[str], title: str, ylabel: str, *, path: Path) -> Path | None:
    """One line per metric in `keys` against the step (steps without the metric are gaps);
    None, and nothing written, if no row has any of them."""
    keys = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]
    if not keys:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for key in keys:
        steps = [r["step"] for r in rows]
        values = [r[key] if isinstance(r.get(key), (int, float)) else np.nan for r in rows]
        ax.plot(steps, values, label=key, marker="o" if len(rows) < 20 else None, markersize=3)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return save(plt, fig, path)


def sample_sheet(images: np.ndarray, captions: list[str], title: str, path: Path, *, cols: int = 4,
                 fps: float = FPS) -> Path:
    """Images (B, H, W, 3) uint8 in a grid, each with its caption (original and refined prompts)
    underneath, wrapped to the tile's width, written to `path`; clips (B, F, H, W, 3) as an animated
    sheet of them, `path` with suffix .gif (and .mp4 beside it where imageio[ffmpeg] is installed),
    `fps` frames a second. Returns the file written (the GIF of clips)."""
    images = np.asarray(images)
    clips = images.ndim == 5
    plt = pyplot()
    rows = -(-len(images) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 4.2 * rows), dpi=100, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    shown = []
    for ax, image, caption in zip(axes.flat, images, captions):
        shown.append(ax.imshow(image[0] if clips else image, interpolation="nearest"))
        wrapped = "\n".join(textwrap.fill(line, 38) for line in caption.splitlines())
        ax.text(0.5, -0.03, wrapped, transform=ax.transAxes, ha="center", va="top", fontsize=7, family="monospace")
    fig.suptitle(title)
    if not clips:
        return save(plt, fig, path)
    return write_clip(path, animated(plt, fig, shown, images), fps)[0]


def animated(plt, fig, shown: list, clips: np.ndarray) -> np.ndarray:
    """The frames (F, H, W, 3) uint8 of `fig` with each image artist of `shown` playing its clip of
    `clips` (B, F, H, W, 3): the figure is laid out and drawn once, then only the images are redrawn
    on it, frame by frame (the captions stay as drawn); `fig` is freed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout()
        fig.canvas.draw()
        frames = []
        for f in range(clips.shape[1]):
            for artist, clip in zip(shown, clips):
                artist.set_data(clip[f])
                artist.axes.draw_artist(artist)
            frames.append(np.asarray(fig.canvas.buffer_rgba())[..., :3].copy())
    plt.close(fig)
    return np.stack(frames)


def printable(text: str) -> str:
    """`text` with what a font cannot draw (control characters an LM may write) as '?'."""
    return "".join(c if c.isprintable() else "?" for c in text)


def caption(prompt: str, refinements: dict[str, str], reward: float | None) -> str:
    """The original prompt, then each refiner's refinement, then the sample's total reward."""
    lines = [f"prompt: {printable(prompt)}"] + [f"{e}: {printable(text) or '-'}" for e, text in refinements.items()]
    if reward is not None:
        lines.append(f"reward {reward:.3f}")
    return "\n".join(lines)
