"""The embedded `shapes_video` world: shapes that move as the prompt says, in clips of a few frames.

The image world's shapes, colours and detector (tasks/shapes.py), put in motion: a prompt names its
objects and one motion ("a red circle moving left", "two green squares moving apart", "a blue
triangle growing"); the renderer draws the clip the prompt asks for (pretraining's ground truth);
the detector finds the objects in every frame and follows them, so a clip is scored on its
objects frame by frame and on the direction and extent of their motion.

Its vocabulary is the image world's with the motion words appended (the image words keep their
ids, so a refiner of the image world reads these prompts' objects, and its refinements mean the
same to both worlds' text encoders).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from tasks.shapes import (DIM, PALETTE, SHAPE_AREA, SHAPES, SHAPES_VOCABULARY, VOCAB, ObjectClause, _mask, _noun,
                          colour_map, detect, encode_in, held_out_set)

MOTION_WORDS = ("moving", "up", "down", "growing", "shrinking", "apart", "together")
VIDEO_VOCAB: list[str] = VOCAB + [w for w in MOTION_WORDS if w not in VOCAB]
VIDEO_WORD_TO_ID = {w: i for i, w in enumerate(VIDEO_VOCAB)}
VIDEO_VOCABULARY = replace(SHAPES_VOCABULARY, words=tuple(VIDEO_VOCAB))  # the image words keep their ids
MAX_VIDEO_WORDS = 16

DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
SIZES = ("growing", "shrinking")
PAIRS = ("apart", "together")
# direction: one object moving; size: one object growing or shrinking; pair: two alike objects
# moving apart or together; counting: two or three alike objects moving one way; colors: two
# objects of different colours moving apart or together
VIDEO_CATEGORIES = ("direction", "size", "pair", "counting", "colors")
FRAMES = (4, 8)  # the clip lengths the world is drawn for (its motions span the whole clip)

RADIUS = 0.14  # of the frame side: an object that does not change size
SIZE_RADII = (0.09, 0.2)  # a growing object's radius in its first and last frame (a shrinking one's reversed)
EXTENT = 0.3  # of the frame side: how far a moving object's centre travels over the clip
SPREAD = 0.33  # of the frame side: centre-to-centre distance of several objects moving together
PAIR_GAPS = (0.375, 0.6875)  # of the frame side: a pair's centre distance, first and last frame (apart)
JITTER = 1.5  # pixels: the whole layout is shifted by up to this, the same in every frame
SHAPE_AREA_MIN = 24  # pixels: a smaller blob's shape is not judged (too few pixels to tell a circle from a square)
SHAPE_FRAMES = 0.6  # a shape is right when the detector sees it in this share of the frames (one frame in a
                     # few shows a 32 px circle's pixels as a square's)
SLACK = 0.75  # a motion's score is full at this share of its rendered extent (pixel-grid and detector slack)


@dataclass(frozen=True)
class VideoPrompt:
    """A clip's prompt: its text, its objects and their motion (what the detector checks)."""
    text: str
    category: str
    objects: tuple[ObjectClause, ...]
    motion: str  # a DIRECTIONS key, a SIZES or a PAIRS word
    ids: tuple[int, ...] = field(default=(), compare=False)

    @property
    def metadata(self) -> dict:
        """GenEval-like metadata: `tag` (the category), `include` (each object's class, count and
        colour) and the `motion`."""
        return {"tag": self.category, "motion": self.motion,
                "include": [{"class": o.shape, "count": o.count, "color": o.colour} for o in self.objects]}

    @staticmethod
    def make(text: str, category: str, objects, motion: str) -> "VideoPrompt":
        return VideoPrompt(text, category, tuple(objects), motion, tuple(encode_video_words(text.split())))


def encode_video_words(words: list[str]) -> list[int]:
    """Word ids in the video vocabulary; an empty, over-long or unknown-word prompt is an error."""
    return encode_in(words, VIDEO_WORD_TO_ID, MAX_VIDEO_WORDS, "shapes_video")


def motion_phrase(motion: str) -> str:
    return f"moving {motion}" if motion in DIRECTIONS or motion in PAIRS else motion


def make_video_prompt(category: str, rng: np.random.Generator, terse: bool = False) -> VideoPrompt:
    """A random prompt of `category`; `terse` drops the articles ("red circle moving left")."""
    c1, c2 = (str(c) for c in rng.choice(list(PALETTE), size=2, replace=False))
    s1, s2 = (str(s) for s in rng.choice(SHAPES, size=2, replace=True))
    if category in ("direction", "size"):
        obj = ObjectClause(s1, c1)
        motion = str(rng.choice(list(DIRECTIONS) if category == "direction" else SIZES))
        return VideoPrompt.make(f"{_noun(obj, terse)} {motion_phrase(motion)}", category, [obj], motion)
    if category in ("pair", "counting"):
        obj = ObjectClause(s1, c1, 2 if category == "pair" else int(rng.integers(2, 4)))
        motion = str(rng.choice(PAIRS if category == "pair" else list(DIRECTIONS)))
        return VideoPrompt.make(f"{_noun(obj, terse)} {motion_phrase(motion)}", category, [obj], motion)
    if category != "colors":
        raise ValueError(f"no video category {category!r} (one of {', '.join(VIDEO_CATEGORIES)})")
    a, b = ObjectClause(s1, c1), ObjectClause(s2, c2)
    motion = str(rng.choice(PAIRS))
    return VideoPrompt.make(f"{_noun(a, terse)} and {_noun(b, terse)} {motion_phrase(motion)}", category, [a, b],
                            motion)


def video_prompt_set(n: int, seed: int) -> list[VideoPrompt]:
    """`n` prompts cycling through the categories, in terse and full forms, from `seed` alone."""
    rng = np.random.default_rng(seed)
    return [make_video_prompt(VIDEO_CATEGORIES[i % len(VIDEO_CATEGORIES)], rng, terse=bool(i % 2))
            for i in range(n)]


def video_clause_key(prompt: VideoPrompt) -> tuple:
    """What a prompt asks, whatever its wording: its objects (in any order) and their motion."""
    return frozenset(prompt.objects), prompt.motion


def video_eval_set(per_category: int, seed: int, exclude: list[VideoPrompt] = ()) -> list[VideoPrompt]:
    """A fixed held-out set in full wording, `per_category` prompts per category, none asking what a
    prompt of `exclude` (the training prompts) asks; a small category may repeat a prompt."""
    return held_out_set(VIDEO_CATEGORIES, make_video_prompt, video_clause_key, per_category, seed=seed, exclude=exclude)


# --- rendering ---------------------------------------------------------------------------------- #

@dataclass(frozen=True)
class Track:
    """One object through a clip: its centre and radius (pixels) in the first and last frame,
    linear in between."""
    shape: str
    colour: str
    start: tuple[float, float, float]  # (cx, cy, r)
    end: tuple[float, float, float]

    def at(self, t: float) -> tuple[float, float, float]:
        return tuple(a + (b - a) * t for a, b in zip(self.start, self.end))


def tracks(prompt: VideoPrompt, size: int, rng: np.random.Generator) -> list[Track]:
    """Every object's track for the motion `prompt` asks: a translation spans EXTENT of the frame
    about its centre, several objects side by side across the motion; a size change spans
    SIZE_RADII; a pair's centres PAIR_GAPS apart about the middle, in random order. The layout is
    jittered by up to JITTER pixels, the same in every frame."""
    mid = size / 2 + rng.uniform(-JITTER, JITTER, size=2)
    r = RADIUS * size
    if prompt.motion in DIRECTIONS:
        (obj,) = prompt.objects
        u = np.array(DIRECTIONS[prompt.motion])
        across = np.array([u[1], u[0]])
        half = u * EXTENT * size / 2
        out = []
        for k in range(obj.count):
            c = mid + across * SPREAD * size * (k - (obj.count - 1) / 2)
            out.append(Track(obj.shape, obj.colour, (*(c - half), r), (*(c + half), r)))
        return out
    if prompt.motion in SIZES:
        (obj,) = prompt.objects
        r0, r1 = (x * size for x in (SIZE_RADII if prompt.motion == "growing" else SIZE_RADII[::-1]))
        return [Track(obj.shape, obj.colour, (*mid, r0), (*mid, r1))]
    objs = list(prompt.objects) if len(prompt.objects) == 2 else [prompt.objects[0]] * 2
    if rng.random() < 0.5:
        objs = objs[::-1]
    g0, g1 = (g * size / 2 for g in (PAIR_GAPS if prompt.motion == "apart" else PAIR_GAPS[::-1]))
    return [Track(o.shape, o.colour, (mid[0] + side * g0, mid[1], r), (mid[0] + side * g1, mid[1], r))
            for o, side in zip(objs, (-1, 1))]


def render_clip(prompt: VideoPrompt, rng: np.random.Generator, frames: int, size: int = 32,
                *, degraded: bool = False) -> np.ndarray:
    """A ground-truth clip for `prompt`: uint8 (F, H, W, 3) on black. `degraded`: colours too dim
    for the detector (the low-quality share of the data, as the image world's)."""
    clip = np.zeros((frames, size, size, 3), np.uint8)
    for obj in tracks(prompt, size, rng):
        for f in range(frames):
            cx, cy, r = obj.at(f / (frames - 1))
            clip[f][_mask(obj.shape, cx, cy, r, size=size)] = PALETTE[obj.colour]
    return (clip * DIM).astype(np.uint8) if degraded else clip


# --- detection ---------------------------------------------------------------------------------- #

def _steady(values: list[float], sign: float, wanted: float) -> float:
    """Share of frame-to-frame steps that do not go back against the asked way (`sign`); 0 where
    the whole clip moved the asked way by less than a quarter of what earns full credit of the
    `wanted` change (a still clip, or one moving across the asked way, is not steady motion)."""
    steps = np.diff(values) * sign
    return float((steps >= 0).mean()) if steps.sum() >= SLACK * wanted / 4 else 0.0


def _extent(change: float, wanted: float) -> float:
    """`change` as a share of SLACK x the rendered `wanted` change, in [0, 1]."""
    return float(np.clip(change / (SLACK * wanted), 0.0, 1.0))


def motion_checks(found: list[list], covered: list[int], prompt: VideoPrompt, size: int) -> list[float]:
    """The motion's extent and steadiness, each in [0, 1]; both 0 where a frame lacks what the
    motion is measured on. `found[f]`: frame f's blobs of the prompt's colours; `covered[f]`: its
    pixels of them (a size change is measured on these: a small shape's blob loses its thin tips)."""
    if prompt.motion in PAIRS:
        def ends(blobs):  # the two objects: the largest of each colour, or the two largest of one
            if len(prompt.objects) == 2:
                per = [[b for b in blobs if b.colour == o.colour] for o in prompt.objects]
                return [max(p, key=lambda b: b.area) for p in per] if all(per) else None
            alike = sorted(blobs, key=lambda b: -b.area)[:2]
            return alike if len(alike) == 2 else None
        pairs = [ends(blobs) for blobs in found]
        if any(p is None for p in pairs):
            return [0.0, 0.0]
        gaps = [float(np.hypot(a.cx - b.cx, a.cy - b.cy)) for a, b in pairs]
        sign = 1.0 if prompt.motion == "apart" else -1.0
        wanted = (PAIR_GAPS[1] - PAIR_GAPS[0]) * size
        return [_extent(sign * (gaps[-1] - gaps[0]), wanted), _steady(gaps, sign, wanted)]
    if any(not blobs for blobs in found):
        return [0.0, 0.0]
    if prompt.motion in SIZES:
        areas = [float(n) for n in covered]
        sign = 1.0 if prompt.motion == "growing" else -1.0
        wanted = 2 * np.log(SIZE_RADII[1] / SIZE_RADII[0])  # log of the area ratio
        return [_extent(sign * (np.log(areas[-1]) - np.log(areas[0])), wanted), _steady(np.log(areas), sign, wanted)]
    u = np.array(DIRECTIONS[prompt.motion])
    along = [float(np.dot(u, np.mean([(b.cx, b.cy) for b in blobs], 0))) for blobs in found]
    return [_extent(along[-1] - along[0], EXTENT * size), _steady(along, 1.0, EXTENT * size)]


def clip_checks(clip: np.ndarray, prompt: VideoPrompt) -> list[float]:
    """The checks of a uint8 clip (F, H, W, 3) against `prompt`, each in [0, 1]; strict accuracy:
    all are 1. Per object, averaged over frames as the image world checks an image: its colour
    present (coverage of the object's smallest rendered area), its shape right (in the frames where
    its blobs are large enough to tell; full credit from SHAPE_FRAMES of them), its count exact;
    then the motion's extent and steadiness (`motion_checks`) of the objects the detector follows."""
    size = clip.shape[1]
    per_frame = [detect(frame) for frame in clip]
    palette = list(PALETTE)
    small = size * (SIZE_RADII[0] if prompt.motion in SIZES else RADIUS)
    maps = [colour_map(frame) for frame in clip]
    checks = []
    for obj in prompt.objects:
        expected = 0.6 * SHAPE_AREA[obj.shape] * small ** 2 * obj.count  # 0.6: pixel-grid slack
        colour, shape, count = [], [], []
        for cmap, blobs in zip(maps, per_frame):
            mine = [b for b in blobs if b.colour == obj.colour]
            cover = (cmap == palette.index(obj.colour)).sum() / expected
            colour.append(min(1.0, cover))
            count.append(float(len(mine) == obj.count))
            judged = [b for b in mine if b.area >= SHAPE_AREA_MIN]
            if judged:
                shape.append(min(1.0, sum(b.shape == obj.shape for b in judged) / min(obj.count, len(judged))))
        shape_right = min(1.0, sum(shape) / (SHAPE_FRAMES * len(shape))) if shape else 0.0
        checks += [float(np.mean(colour)), shape_right, float(np.mean(count))]
    colours = {o.colour for o in prompt.objects}
    ids = [palette.index(c) for c in colours]
    checks += motion_checks([[b for b in blobs if b.colour in colours] for blobs in per_frame],
                            [int(np.isin(cmap, ids).sum()) for cmap in maps], prompt, size)
    return checks


def clip_correct(clip: np.ndarray, prompt: VideoPrompt) -> bool:
    return all(c >= 1.0 for c in clip_checks(clip, prompt))
