"""An image reward term scored on a video: `reward.terms.<name>.per_frame: {frames: k, reduce: mean|min}`.

The peers score video generators with image rewards frame by frame: Flow-Factory and miles average
PickScore over a Wan clip's frames, verl-omni scores Wan2.2 with HPSv3 per frame. `PerFrame` wraps
any image term (a built-in or a user's) once, around the scorer where the samples are (a rollout
worker: a term scored by reward actors is sent the chosen frames only): of each clip (F, 3, H, W) it takes
k frames spread evenly over the clip, the first and the last among them (k = 1: the middle frame),
scores all B x k frames in one call of the image term (which runs them in passes of its own
`batch_size`), each frame against its clip's prompt and refinements, and reduces each clip's k
scores to one: `mean` (the peers' average), or `min` (a clip is as good as its worst frame).
"""
from __future__ import annotations

from typing import Callable, Literal, Sequence

import numpy as np
from pydantic import Field, PositiveInt

from common.config import Strict


class PerFrameConfig(Strict):
    """Score an image term on k frames of each clip and reduce them to one value per clip."""
    frames: PositiveInt = Field(description="frames of each clip scored, spread evenly over it, the first and "
                                            "last among them (1: the middle frame); at most task.num_frames")
    reduce: Literal["mean", "min"] = Field("mean", description="one value per clip from its frames' scores: "
                                                               "their mean, or their minimum (the worst frame)")


def frame_indices(num_frames: int, k: int) -> np.ndarray:
    """The k frames of a clip of `num_frames` that are scored: evenly spaced from the first to the
    last (rounded half up, so distinct for k <= num_frames); k = 1: the middle one."""
    if not 1 <= k <= num_frames:
        raise ValueError(f"cannot score {k} frames of a clip of {num_frames}")
    if k == 1:
        return np.array([(num_frames - 1) // 2])
    return np.floor(np.linspace(0, num_frames - 1, k) + 0.5).astype(int)


class PerFrame:
    """An image scorer called on clips: see the module docstring. `strict` (where the image term
    has one, e.g. GenEval's) holds for a clip when it holds on every frame scored."""

    def __init__(self, scorer: Callable, frames: int, reduce: str):
        self.scorer, self.frames, self.reduce = scorer, frames, reduce

    def frames_of(self, clips: np.ndarray, prompts: Sequence, refinements: Sequence[dict]):
        """(B x k frames (3, H, W), each frame's prompt, each frame's refinements), clip by clip."""
        clips = np.asarray(clips)
        if clips.ndim != 5:
            raise ValueError(f"per_frame scores clips (B, F, 3, H, W); got an array of shape {clips.shape}")
        chosen = clips[:, frame_indices(clips.shape[1], self.frames)]
        k = self.frames
        return (chosen.reshape(-1, *clips.shape[2:]), [p for p in prompts for _ in range(k)],
                [r for r in refinements for _ in range(k)])

    def per_clip(self, values, n: int, reduce: str) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64).reshape(n, self.frames)
        return values.mean(1) if reduce == "mean" else values.min(1)

    def __call__(self, clips: np.ndarray, prompts: Sequence, refinements: Sequence[dict]) -> np.ndarray:
        return self.per_clip(self.scorer(*self.frames_of(clips, prompts, refinements)), len(prompts), self.reduce)

    def strict(self, clips: np.ndarray, prompts: Sequence, refinements: Sequence[dict]) -> np.ndarray | None:
        strict = getattr(self.scorer, "strict", None)
        found = strict(*self.frames_of(clips, prompts, refinements)) if strict else None
        return None if found is None else self.per_clip(found, len(prompts), "min")
