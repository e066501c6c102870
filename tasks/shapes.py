"""The embedded `shapes` world: vocabulary, prompts with clause metadata, a renderer and a detector.

Everything a joint prompt-refiner + generator run needs, small enough for two CPU cores: prompts in
GenEval-like categories, procedurally rendered ground truth, and a programmatic detector that scores
an image against the *original* prompt's clauses.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from tasks.base import Vocabulary

SPECIAL = ["<pad>", "<bos>", "<eos>", "<sep>"]
PAD, BOS, EOS, SEP = range(4)

PALETTE = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 230),
    "yellow": (230, 210, 40),
    "purple": (160, 60, 200),
    "orange": (245, 140, 30),
}
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = {"one": 1, "two": 2, "three": 3}
SHAPE_AREA = {"circle": np.pi, "square": 1.7 ** 2, "triangle": 2.0}  # in units of radius^2, as rendered
RELATIONS = ("left", "right", "above", "below")
STYLE_WORDS = ("large", "small", "bright", "sharp", "clean", "detailed", "centered", "simple",
               "bold", "vivid", "plain", "background", "black", "photo", "image", "showing")
QUALITY_WORDS = ("sharp", "clean", "vivid", "bright", "detailed")  # style words that go with clean images
GLUE_WORDS = ("a", "an", "and", "of", "the", "with", "to", "on", "picture", "that", "is", "in")

VOCAB: list[str] = (SPECIAL + list(PALETTE) + list(SHAPES) + [s + "s" for s in SHAPES]
                    + list(COUNT_WORDS) + list(RELATIONS) + list(STYLE_WORDS) + list(GLUE_WORDS))
WORD_TO_ID = {w: i for i, w in enumerate(VOCAB)}
RARE_SYNONYMS = {"red": "crimson", "green": "emerald", "blue": "azure", "yellow": "golden", "purple": "violet",
                 "orange": "amber", "circle": "disc", "square": "tile", "triangle": "wedge", "circles": "discs",
                 "squares": "tiles", "triangles": "wedges", "two": "twin", "three": "triple", "left": "west",
                 "right": "east", "above": "atop", "below": "beneath"}
RARE_VOCAB: list[str] = VOCAB + list(RARE_SYNONYMS.values())  # the usual words keep their ids
RARE_WORD_TO_ID = {w: i for i, w in enumerate(RARE_VOCAB)}
MAX_PROMPT_WORDS = 16
SHAPES_VOCABULARY = Vocabulary(tuple(VOCAB), PAD, BOS, EOS, SEP, MAX_PROMPT_WORDS)
RARE_VOCABULARY = replace(SHAPES_VOCABULARY, words=tuple(RARE_VOCAB))  # the usual words keep their ids
CATEGORIES = ("single_object", "two_objects", "counting", "colors", "position", "color_attr")


def encode_words(words: list[str]) -> list[int]:
    """Word ids for a prompt's `words`; an empty, over-long or unknown-word prompt is an error."""
    return encode_in(words, WORD_TO_ID, MAX_PROMPT_WORDS, "shapes")


def encode_in(words: list[str], word_to_id: dict[str, int], max_words: int, world: str) -> list[int]:
    """Word ids of `words` in the vocabulary `word_to_id` of the task `world` (shapes or its video
    world), at most `max_words` of them; an empty, over-long or unknown-word prompt is an error."""
    if not words or len(words) > max_words:
        raise ValueError(f"a prompt needs 1 to {max_words} words, got {len(words)}: {' '.join(words)!r}")
    unknown = [w for w in words if w not in word_to_id]
    if unknown:
        raise ValueError(f"words outside the {world} vocabulary: {unknown}")
    return [word_to_id[w] for w in words]


@dataclass(frozen=True)
class ObjectClause:
    shape: str
    colour: str
    count: int = 1


@dataclass(frozen=True)
class Prompt:
    """A prompt's text and the clauses the detector checks it against."""
    text: str
    category: str
    objects: tuple[ObjectClause, ...]
    relation: str | None = None  # objects[0] is <relation> of objects[1]
    ids: tuple[int, ...] = field(default=(), compare=False)

    @property
    def metadata(self) -> dict:
        """The clauses as a plain dict, in GenEval's metadata format: `tag` (the category) and
        `include` (each object's class, count and colour), with the relation between them."""
        return {"tag": self.category, "relation": self.relation,
                "include": [{"class": o.shape, "count": o.count, "color": o.colour} for o in self.objects]}

    @staticmethod
    def make(text: str, category: str, objects, relation=None) -> "Prompt":
        return Prompt(text, category, tuple(objects), relation, tuple(encode_words(text.split())))


def _noun(obj: ObjectClause, terse: bool) -> str:
    shape = obj.shape + ("s" if obj.count > 1 else "")
    if obj.count > 1:
        count = [w for w, n in COUNT_WORDS.items() if n == obj.count][0]
        return f"{count} {obj.colour} {shape}"
    return f"{obj.colour} {shape}" if terse else f"a {obj.colour} {shape}"


def make_prompt(category: str, rng: np.random.Generator, terse: bool = False) -> Prompt:
    colours = list(PALETTE)
    c1, c2 = rng.choice(colours, size=2, replace=False)
    s1, s2 = rng.choice(SHAPES, size=2, replace=True)
    if category in ("single_object", "colors"):
        obj = ObjectClause(str(s1), str(c1))
        text = _noun(obj, terse) if category == "single_object" or terse else f"a photo of a {c1} {s1}"
        return Prompt.make(text, category, [obj])
    if category == "counting":
        obj = ObjectClause(str(s1), str(c1), int(rng.integers(2, 4)))
        return Prompt.make(_noun(obj, terse), category, [obj])
    a, b = ObjectClause(str(s1), str(c1)), ObjectClause(str(s2), str(c2))
    if category == "position":
        rel = str(rng.choice(RELATIONS))
        link = f"{rel} of" if rel in ("left", "right") else rel
        return Prompt.make(f"{_noun(a, terse)} {link} {_noun(b, terse)}", category, [a, b], rel)
    return Prompt.make(f"{_noun(a, terse)} and {_noun(b, terse)}", category, [a, b])


def prompt_set(n: int, seed: int) -> list[Prompt]:
    """`n` prompts cycling through the categories, in terse and full forms, from `seed` alone."""
    rng = np.random.default_rng(seed)
    return [make_prompt(CATEGORIES[i % len(CATEGORIES)], rng, terse=bool(i % 2)) for i in range(n)]


INVERSE = {"left": "right", "right": "left", "above": "below", "below": "above"}


def paraphrase(prompt: Prompt) -> Prompt:
    """The same clauses in other words: attributes after the noun, objects swapped, relations inverted."""
    def reworded(o: ObjectClause) -> str:
        if o.count > 1:
            return f"{[w for w, n in COUNT_WORDS.items() if n == o.count][0]} {o.shape}s in {o.colour}"
        return f"a {o.shape} that is {o.colour}"
    objs = prompt.objects
    if len(objs) == 1:
        return Prompt.make(reworded(objs[0]), prompt.category, objs)
    a, b = objs
    if prompt.relation:
        rel = INVERSE[prompt.relation]
        link = f"{rel} of" if rel in ("left", "right") else rel
        return Prompt.make(f"{reworded(b)} {link} {reworded(a)}", prompt.category, [b, a], rel)
    return Prompt.make(f"{reworded(b)} and {reworded(a)}", prompt.category, [b, a])


def rare_worded(prompt: Prompt) -> Prompt:
    """The same prompt with every colour, shape, count and relation said in its rare synonym
    (`RARE_SYNONYMS`: words a base's pretraining captions use rarely, as real captions have a long
    tail), read in `RARE_VOCAB`; the clauses the detector checks are the prompt's."""
    words = [RARE_SYNONYMS.get(w, w) for w in prompt.text.split()]
    return Prompt(" ".join(words), prompt.category, prompt.objects, prompt.relation,
                  tuple(encode_in(words, RARE_WORD_TO_ID, MAX_PROMPT_WORDS, "shapes (rare wording)")))


def clause_key(prompt: Prompt) -> tuple:
    return (frozenset(prompt.objects), prompt.relation and (prompt.objects, prompt.relation))


def eval_set(per_category: int, seed: int, exclude: list[Prompt] = ()) -> list[Prompt]:
    """A fixed held-out set in full wording, `per_category` prompts per category, none whose clauses
    appear in `exclude` (the training prompts); a small category may repeat a clause set."""
    return held_out_set(CATEGORIES, make_prompt, clause_key, per_category, seed=seed, exclude=exclude)


def held_out_set(categories, make, key, per_category: int, *, seed: int, exclude=()) -> list:
    """`per_category` prompts drawn by `make(category, rng)` for each category, none whose `key`
    is a training prompt's (`exclude`): the held-out draw of both shapes worlds."""
    rng = np.random.default_rng(seed)
    seen = {key(p) for p in exclude}
    out = []
    for cat in categories:
        for _ in range(per_category):
            for _attempt in range(1000):
                p = make(cat, rng)
                if key(p) not in seen:
                    break
            else:
                raise ValueError(f"no held-out {cat} prompt left: the training prompts cover them all")
            out.append(p)
    return out


# --- rendering ---------------------------------------------------------------------------------- #

def _mask(shape: str, cx: float, cy: float, r: float, *, size: int) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    if shape == "circle":
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
    if shape == "square":
        return (np.abs(xx - cx) <= r * 0.85) & (np.abs(yy - cy) <= r * 0.85)
    top, bottom = cy - r, cy + r  # upright isosceles triangle
    half = (yy - top) / (2 * r) * r
    return (yy >= top) & (yy <= bottom) & (np.abs(xx - cx) <= half)


def render(prompt: Prompt, rng: np.random.Generator, size: int = 32, degraded: bool = False) -> np.ndarray:
    """A ground-truth image for `prompt`: uint8 (H, W, 3) on a black background. `degraded` is the
    low-quality share of a web-scale dataset: colours too dim for the detector to match."""
    img = np.zeros((size, size, 3), np.uint8)
    r = size * RADIUS
    slots = _slots(prompt, size, rng)
    for obj, centres in zip(prompt.objects, slots):
        for cx, cy in centres:
            img[_mask(obj.shape, cx, cy, r, size=size)] = PALETTE[obj.colour]
    if degraded:
        img = (img * DIM).astype(np.uint8)
    return img


RADIUS = 0.15  # of the image side
DIM = 0.55  # a degraded image's colour scale: too dim for the detector to match the palette
ROW = {1: [(1, 1)], 2: [(0, 1), (2, 1)], 3: [(0, 0), (2, 0), (1, 2)]}
PAIR = {None: ((0, 1), (2, 1)), "left": ((0, 1), (2, 1)), "right": ((2, 1), (0, 1)),
        "above": ((1, 0), (1, 2)), "below": ((1, 2), (1, 0))}


def _slots(prompt: Prompt, size: int, rng: np.random.Generator) -> list[list[tuple[float, float]]]:
    """Object centres on a 3x3 grid of cells, in a canonical layout for the clauses (one object in
    the middle, two side by side, three in a triangle, a pair side by side or as its relation says),
    jittered by up to half a pixel."""
    cell = size / 3
    centre = lambda i, j: ((i + 0.5) * cell + rng.uniform(-0.5, 0.5), (j + 0.5) * cell + rng.uniform(-0.5, 0.5))
    if len(prompt.objects) == 1:
        return [[centre(*c) for c in ROW[prompt.objects[0].count]]]
    return [[centre(*c)] for c in PAIR[prompt.relation]]


# --- detection ---------------------------------------------------------------------------------- #

@dataclass(frozen=True)
class Blob:
    colour: str
    shape: str
    area: int
    cx: float
    cy: float


def colour_map(img: np.ndarray, tolerance: float = 70.0) -> np.ndarray:
    """Per pixel, the index of the nearest palette colour within `tolerance`, else -1."""
    pal = np.array(list(PALETTE.values()), np.float32)
    dist = np.linalg.norm(img[:, :, None, :].astype(np.float32) - pal[None, None], axis=-1)
    idx = dist.argmin(-1)
    idx[dist.min(-1) > tolerance] = -1
    return idx


def detect(img: np.ndarray, min_area: int = 6) -> list[Blob]:
    """Connected components (4-neighbour) per palette colour, each classified by its fill ratio."""
    cmap = colour_map(img)
    h, w = cmap.shape
    seen = np.zeros_like(cmap, bool)
    names = list(PALETTE)
    blobs = []
    for y0 in range(h):
        for x0 in range(w):
            if cmap[y0, x0] < 0 or seen[y0, x0]:
                continue
            c, stack, pix = cmap[y0, x0], [(y0, x0)], []
            seen[y0, x0] = True
            while stack:
                y, x = stack.pop()
                pix.append((y, x))
                for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and cmap[ny, nx] == c:
                        seen[ny, nx] = True
                        stack.append((ny, nx))
            if len(pix) < min_area:
                continue
            ys, xs = np.array(pix).T
            blobs.append(Blob(names[c], classify(ys, xs), len(pix), xs.mean() + 0.5, ys.mean() + 0.5))
    return blobs


def classify(ys: np.ndarray, xs: np.ndarray) -> str:
    """The shape whose ideal mask, fitted to the component's bounding box, overlaps it best (IoU)."""
    h, w = np.ptp(ys) + 1, np.ptp(xs) + 1
    blob = np.zeros((h, w), bool)
    blob[ys - ys.min(), xs - xs.min()] = True
    yy, xx = (np.mgrid[0:h, 0:w] + 0.5) / np.array([h, w])[:, None, None]
    ideal = {"square": np.ones((h, w), bool),
             "circle": (xx - 0.5) ** 2 + (yy - 0.5) ** 2 <= 0.25,
             "triangle": np.abs(xx - 0.5) <= yy / 2}
    iou = {k: (blob & m).sum() / (blob | m).sum() for k, m in ideal.items()}
    return max(iou, key=iou.get)


def _relation_holds(rel: str, a: Blob, b: Blob) -> bool:
    return {"left": a.cx < b.cx, "right": a.cx > b.cx, "above": a.cy < b.cy, "below": a.cy > b.cy}[rel]


def image_checks(img: np.ndarray, prompt: Prompt) -> list[float]:
    """GenEval-style checks of `img` against `prompt`, each in [0, 1]. Strict accuracy = all are 1."""
    blobs = detect(img)
    cmap = colour_map(img)
    radius = img.shape[0] * RADIUS
    checks = []
    for obj in prompt.objects:
        mine = [b for b in blobs if b.colour == obj.colour]
        expected = 0.75 * SHAPE_AREA[obj.shape] * radius ** 2 * obj.count  # 0.75: pixel-grid slack
        cover = (cmap == list(PALETTE).index(obj.colour)).sum() / expected
        checks.append(float(min(1.0, cover)))                                  # colour present
        checks.append(min(1.0, sum(b.shape == obj.shape for b in mine) / obj.count))  # shape right
        checks.append(float(len(mine) == obj.count))                          # count exact
    if prompt.relation:
        a = [b for b in blobs if b.colour == prompt.objects[0].colour]
        b = [b for b in blobs if b.colour == prompt.objects[1].colour]
        checks.append(float(bool(a and b) and _relation_holds(prompt.relation, max(a, key=lambda x: x.area),
                                                             max(b, key=lambda x: x.area))))
    return checks


def strict_correct(img: np.ndarray, prompt: Prompt) -> bool:
    return all(c >= 1.0 for c in image_checks(img, prompt))
