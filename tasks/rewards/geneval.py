"""GenEval (Ghosh et al. 2023): an image checked against its prompt's object clauses by a detector.

A GenEval prompt's metadata lists what the image must show, `include: [{class, count, color?,
position?: [relation, index]}]`, and what it must not, `exclude: [{class, count}]` (fewer than
`count` of the class). Each clause is one check (`clauses`, a pure function over detections):

- an include clause's count: its `count` most confident detections exist (at least `count`:
  exactly is asked by a counting prompt's exclude clause of `count + 1`);
- its colour, when it names one: all of those detections are classified as that colour by CLIP,
  zero-shot over GenEval's ten colours with GenEval's three prompts per colour;
- its position, when it names one: each of those detections stands in the relation to each of the
  target clause's, by box centres with a margin of `position_margin` times the boxes' sizes;
- an exclude clause: fewer than `count` detections of its class.

As in GenEval a colour is checked only on a clause whose count holds, and a position only on a
clause whose count and colour hold and whose target clause held entirely. `strict` is 1 only when
all clauses hold: GenEval's correctness (`evaluate`: every include matched, no exclude violated).

The reward (`__call__`) is a partial credit to train on, one of two (`partial`):

- `clauses` (the default): the fraction of the clauses above that hold, each 0 or 1, excludes
  included; 1 exactly when `strict` is. "two clocks" with 0 or 4 clocks found scores 0.5 (the
  count fails; the exclude clause "fewer than 3" holds for 0, fails for 4).
- `flow_grpo`: Flow-GRPO's training reward (`flow_grpo_credit`; reward-server `evaluate_reward`),
  the mean of graded entries per include clause: 1 - |count - found| / count for the count, over
  *every* detection kept of the class (exactly `count` is wanted; it is negative past twice the
  count); a count that is not exact adds one 0 for the colour and position it names (one 0 for
  both) and stops there; otherwise n / count for the colour (n: objects classified that colour)
  and, when the colour is right, 1 for a position that holds, 0 when its target clause failed, and
  0 *then* 1 when a relation fails (the source appends 1 after its loop whatever the loop found).
  Exclude clauses are not read. "two clocks" with 0 or 4 found scores 0, with 1 or 3 found 0.5.
  (`strict` stays GenEval's: what Flow-GRPO logs as `accuracy`; its `strict_accuracy` is
  `evaluate_reward`'s own verdict, exact counts and colours, which no term here reports.)

References: github djghosh13/geneval at af4902f, `evaluation/evaluate_images.py` (cited below by
line), and Flow-GRPO's GenEval reward (github yifan123/flow_grpo at ac4c86e,
`flow_grpo/rewards.py` `geneval_score`, which calls github yifan123/reward-server at 92ac29f,
`reward_server/gen_eval.py` `evaluate_reward`, the `score` it returns; its selection of boxes and
its thresholds are GenEval's). tests/test_rewards_geneval.py checks both against transcriptions of
those two functions on thousands of random detection sets.

Where this differs from GenEval's own pipeline (and so from Flow-GRPO's reward server):

- Detector. GenEval runs Mask2Former (Swin-S, mmdet) over the 80 COCO classes, every class for
  every image. Here an open-vocabulary detector from `transformers` is asked for the prompt's own
  classes (include and exclude) only: OWLv2 with queries "a photo of a {class}" (as transformers'
  OWLv2 examples query; `query_template` changes it), or Grounding DINO with "class. class." (its
  convention), a class's score being the best over its tokens. Each box counts for one class, the
  query it matches best (as `post_process_object_detection` does), where Mask2Former may list a
  mask under several.
- Thresholds, one pair per detector (`thresholds.<detector>.{score, counting}`). The defaults are
  GenEval's (0.3, and 0.9 for `counting` prompts, l.286-287), set for Mask2Former's scores; OWLv2's
  run lower (owlv2-base-patch16-ensemble scores the two plain cats of COCO val2017 000000039769 at
  0.74 and 0.63: github huggingface/transformers.js #579), so at 0.9 a counting prompt is rarely
  met. Until they are calibrated for the detector on a labelled set (README: "GenEval figures"),
  accuracies from this reward are not comparable with published GenEval figures.
  `max_objects` (16) and `max_overlap` (1.0: no suppression) are GenEval's too (l.288-289); OWLv2
  predicts a box per image patch, not a set as Mask2Former and Grounding DINO do, so duplicates are
  not trained away and a `max_overlap` such as 0.5 may be wanted for counting.
- Colour crops. GenEval classifies each object's Mask2Former mask pasted on grey (#999) and cut to
  its box (l.84-102); with no segmenter the whole box is cut, background included.
- CLIP. GenEval's open_clip ViT-L-14 (openai weights, l.66) is `openai/clip-vit-large-patch14`
  here, the same weights through `transformers`.
- OWLv2 input. transformers' PIL `Owlv2ImageProcessor` resizes with scipy (not a dependency here);
  images are padded to a square at the bottom right and resized with PIL's antialiased bilinear
  instead, then only rescaled and normalised by the processor.
- Images. Flow-GRPO sends the server JPEG-compressed images (`geneval_score`); they are scored
  here as generated.
"""
from __future__ import annotations

from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import torch
from pydantic import Field

from common.config import Strict
from common.hub import ModelRef
from tasks.base import Refinement
from tasks.rewards.base import Options, RewardModel, pil_images
from tasks.rewards.clip import ClipEncoder, features, unit
from tasks.rewards.detectors import DEFAULT_MODELS, QUERY_TEMPLATES, Box, Detection, load_detector, ranked, select

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")  # l.76
COLOUR_TEMPLATES = ("a photo of a {c} {o}", "a photo of a {c}-colored {o}", "a photo of a {c} object")  # l.114-116
RELATIONS = ("left of", "right of", "above", "below")  # l.153-156


# --- the clauses ---------------------------------------------------------------------------------- #

def relative_position(a: Box, b: Box, margin: float) -> set[str]:
    """The relations of box `a` to box `b` (GenEval `relative_position`, l.140-157): the offset of
    the centres, each axis shrunk by `margin` times the two boxes' sizes along it, must point within
    60 degrees of a direction (its share of the full offset's length beyond 0.5). Image y points down."""
    boxes = np.array([a, b], dtype=np.float64).reshape(2, 2, 2)
    centre_a, centre_b = boxes.mean(axis=1)
    size_a, size_b = np.abs(boxes[:, 1] - boxes[:, 0])
    offset = centre_a - centre_b
    revised = np.maximum(np.abs(offset) - margin * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    return {rel for rel, holds in (("left of", dx < -0.5), ("right of", dx > 0.5),
                                    ("above", dy < -0.5), ("below", dy > 0.5)) if holds}


def clauses(metadata: Mapping[str, Any], detections: Sequence[Detection],
            colour_of: Callable[[Detection], str], position_margin: float = 0.1) -> list[bool]:
    """One verdict per clause, in order: per include clause its count, then its colour and its
    position if it names them; then one per exclude clause (GenEval `evaluate`, l.161-220).
    `colour_of` is asked only about the detections `to_colour` lists."""
    found = ranked(detections)
    verdicts: list[bool] = []
    groups: list[list[Detection] | None] = []  # per include clause: its objects, if it held entirely
    for req in metadata["include"]:
        objects = found.get(req["class"], [])[:req["count"]]
        matched = len(objects) >= req["count"]
        verdicts.append(matched)
        if "color" in req:
            matched = matched and sum(colour_of(d) == req["color"] for d in objects) >= req["count"]
            verdicts.append(matched)
        if "position" in req:
            relation, target = req["position"]
            matched = matched and groups[target] is not None and all(
                relation in relative_position(d.box, t.box, position_margin) for d in objects for t in groups[target])
            verdicts.append(matched)
        groups.append(objects if matched else None)
    verdicts += [len(found.get(req["class"], [])) < req["count"] for req in metadata.get("exclude", [])]
    return verdicts


def flow_grpo_credit(metadata: Mapping[str, Any], detections: Sequence[Detection],
                     colour_of: Callable[[Detection], str], position_margin: float = 0.1) -> float:
    """Flow-GRPO's graded reward (reward-server `evaluate_reward`, see the module docstring): the
    mean of the entries each include clause adds; exclude clauses are not read. `colour_of` is
    asked only about the detections `to_colour` lists."""
    found = ranked(detections)
    entries: list[float] = []
    groups: list[list[Detection] | None] = []  # per include clause: its objects, if it held entirely
    for req in metadata["include"]:
        count, objects = req["count"], found.get(req["class"], [])
        entries.append(1 - abs(count - len(objects)) / count)
        matched = len(objects) == count
        if not matched:
            entries += [0.0] if "color" in req or "position" in req else []
        else:
            if "color" in req:
                coloured = sum(colour_of(d) == req["color"] for d in objects)
                entries.append(1 - abs(count - coloured) / count)
                matched = coloured == count
            if "position" in req and matched:
                relation, target = req["position"]
                if groups[target] is None:
                    matched = False
                    entries.append(0.0)
                else:
                    matched = all(relation in relative_position(d.box, t.box, position_margin)
                                  for d in objects for t in groups[target])
                    entries += [1.0] if matched else [0.0, 1.0]
        groups.append(objects if matched else None)
    return sum(entries) / len(entries)


def to_colour(metadata: Mapping[str, Any], detections: Sequence[Detection]) -> list[Detection]:
    """The detections whose colour `clauses` or `flow_grpo_credit` asks about: the `count` most
    confident objects of each clause naming a colour."""
    found = ranked(detections)
    return list(dict.fromkeys(d for req in metadata["include"] if "color" in req
                              for d in found.get(req["class"], [])[:req["count"]]))


def checked(prompt: Any) -> Mapping[str, Any]:
    """The prompt's GenEval metadata, its clauses checked, so that a malformed one is refused here
    with the prompt named rather than failing (or quietly never holding) inside `clauses`."""
    metadata = prompt.metadata
    def refuse(why: str):
        raise ValueError(f"geneval: the prompt {prompt.text!r} {why}; the geneval reward needs GenEval-format "
                         f"prompts (metadata `include: [{{class, count, color?, position?}}]`)")
    include = metadata.get("include")
    if not isinstance(include, list) or not include:
        refuse("has no `include` clauses in its metadata")
    for i, req in enumerate([*include, *metadata.get("exclude", [])]):
        if not (isinstance(req, Mapping) and isinstance(req.get("class"), str) and isinstance(req.get("count"), int)
                and req["count"] >= 1):
            refuse(f"has a clause without a class name and a count >= 1: {req}")
        if "color" in req and req["color"] not in COLORS:
            refuse(f"asks for the colour {req['color']!r}, not one of GenEval's {COLORS}")
        position = req.get("position")
        if "position" in req and not (isinstance(position, (list, tuple)) and len(position) == 2
                                         and position[0] in RELATIONS and isinstance(position[1], int)
                                         and 0 <= position[1] < i):
            refuse(f"has a position {position} that is not [one of {RELATIONS}, an earlier clause's index]")
    return metadata


def classes(metadata: Mapping[str, Any]) -> list[str]:
    """The classes to detect for a prompt: those its clauses name, in order, once each."""
    return list(dict.fromkeys(req["class"] for key in ("include", "exclude") for req in metadata.get(key, [])))


# --- colours -------------------------------------------------------------------------------------- #

def crop(image, box: Box):
    """The box cut out of a PIL image, clipped to it and at least one pixel wide and high."""
    w, h = image.size
    x0, y0 = min(max(round(box[0]), 0), w - 1), min(max(round(box[1]), 0), h - 1)
    return image.crop((x0, y0, min(max(round(box[2]), x0 + 1), w), min(max(round(box[3]), y0 + 1), h)))


class ColourClassifier:
    """CLIP zero-shot colour of object crops, as GenEval's `color_classification` (l.107-127): per
    object class, each colour's text embedding is the normalised mean of its three prompts' unit
    embeddings (clip_benchmark `zero_shot_classifier`), and a crop gets the colour it is closest to."""

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device):
        self.clip = ClipEncoder(name, name, dtype, device)

    @torch.no_grad()
    def __call__(self, crops: Sequence, labels: Sequence[str]) -> list[str]:
        """The colour of each crop (one image pass), against its own label's colour prompts (one text pass)."""
        if not crops:
            return []
        names = list(dict.fromkeys(labels))
        texts = [t.format(c=c, o=o) for o in names for c in COLORS for t in COLOUR_TEMPLATES]
        prompts = self.clip.texts(texts).reshape(len(names), len(COLORS), len(COLOUR_TEMPLATES), -1)
        classifier = unit(unit(prompts).mean(2))  # (classes, colours, D)
        pixels = self.clip.processor(images=list(crops), return_tensors="pt")["pixel_values"]
        embeds = unit(features(self.clip.model.get_image_features(
            pixel_values=pixels.to(self.clip.device, self.clip.dtype))))
        rows = classifier[[names.index(o) for o in labels]]  # (crops, colours, D)
        return [COLORS[i] for i in (rows @ embeds[:, :, None]).squeeze(-1).argmax(-1).tolist()]


# --- the reward ----------------------------------------------------------------------------------- #

class Thresholds(Strict):
    """One detector's score thresholds: GenEval's by default, which were set for Mask2Former."""
    score: float = Field(0.3, ge=0, le=1, description="a detection counts above this score (GenEval l.286, "
                         "Mask2Former's; uncalibrated for this detector)")
    counting: float = Field(0.9, ge=0, le=1, description="the same for prompts tagged `counting` (GenEval l.287, "
                            "Mask2Former's; uncalibrated for this detector)")


class DetectorThresholds(Strict):
    """The thresholds of each detector, so that a pair calibrated for one is never used for the other."""
    owlv2: Thresholds = Field(Thresholds(), description="OWLv2's detection thresholds")
    grounding_dino: Thresholds = Field(Thresholds(), description="Grounding DINO's detection thresholds")


class GenEvalOptions(Options):
    detector: Literal["owlv2", "grounding_dino"] | None = Field(
        None, description="the detector's kind; None: read from the model's config. With `model` unset it picks "
                          f"the default model: {DEFAULT_MODELS}")
    query_template: str | None = Field(None, pattern=r"\{\}", description="a class name's query, `{}` the name; "
                                       f"None: {QUERY_TEMPLATES}")
    clip_model: str = Field("openai/clip-vit-large-patch14", description="the CLIP classifying colours: a local "
                            "folder, a hub id or `tiny:clip` (GenEval: open_clip ViT-L-14, openai weights)")
    partial: Literal["clauses", "flow_grpo"] = Field("clauses", description="the reward: clauses (the fraction of "
                                                     "GenEval's 0/1 clauses that hold, excludes included) or "
                                                     "flow_grpo (Flow-GRPO's graded score: exact counts, colour "
                                                     "fractions, no excludes); `strict` is GenEval's either way")
    thresholds: DetectorThresholds = Field(DetectorThresholds(), description="per detector, the score a detection "
                                           "must exceed; GenEval figures are comparable with published ones only "
                                           "once these are calibrated for the detector (docs/reference.md, "
                                           "'Real tasks')")
    max_objects: int = Field(16, ge=1, description="at most this many detections per class (GenEval l.288)")
    max_overlap: float = Field(1.0, gt=0, le=1, description="a detection overlapping a more confident one of its "
                               "class by this IoU or more is dropped; 1: none is (GenEval l.289)")
    position_margin: float = Field(0.1, ge=0, description="centre offsets are shrunk by this times the boxes' "
                                   "sizes before a relation is read (GenEval `position_threshold`, l.290)")


class GenEval(RewardModel):
    """GenEval's clauses checked by an open-vocabulary detector and CLIP (see the module docstring):
    a partial credit (`partial`), or (`strict`) whether all clauses hold."""
    Options = GenEvalOptions
    default_model = DEFAULT_MODELS["owlv2"]
    packages = ("transformers",)

    def __init__(self, options: GenEvalOptions, device: torch.device):
        super().__init__(options, device)
        self.detector = load_detector(self.model_name, options.detector, options.query_template, self.dtype,
                                      device=device,
                                      revision=options.revision)
        self.colours = ColourClassifier(options.clip_model, self.dtype, device)

    @classmethod
    def named_model(cls, options: GenEvalOptions) -> str:
        return options.model or DEFAULT_MODELS[options.detector or "owlv2"]

    @classmethod
    def models(cls, options: GenEvalOptions) -> list[ModelRef]:
        return [*super().models(options), ModelRef(options.clip_model, option="clip_model")]

    def __call__(self, images: np.ndarray, prompts: Sequence[Any],
                 refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        margin = self.options.position_margin
        if self.options.partial == "flow_grpo":
            return np.array([flow_grpo_credit(m, f, c, margin) for m, f, c in self.judged(images, prompts)])
        return np.array([float(np.mean(clauses(m, f, c, margin))) for m, f, c in self.judged(images, prompts)])

    def strict(self, images: np.ndarray, prompts: Sequence[Any],
               refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        """GenEval's correctness: 1 when every clause holds."""
        return np.array([float(all(v)) for v in self.verdicts(images, prompts)])

    def verdicts(self, images: np.ndarray, prompts: Sequence[Any]) -> list[list[bool]]:
        """Each image's clause verdicts (`clauses`)."""
        return [clauses(m, f, c, self.options.position_margin) for m, f, c in self.judged(images, prompts)]

    def judged(self, images: np.ndarray, prompts: Sequence[Any]
               ) -> list[tuple[Mapping[str, Any], list[Detection], Callable[[Detection], str]]]:
        """Per image, what the credits are computed from: its *original* prompt's metadata, the
        detections kept (the detector on `batch_size` images at a time, each image thresholded by
        its prompt's tag with this detector's thresholds) and the colour of each detection a
        clause asks about (CLIP on every such crop, one pass)."""
        metadata = [checked(p) for p in prompts]
        pil = pil_images(images)
        o = self.options
        thresholds: Thresholds = getattr(o.thresholds, self.detector.kind)
        found: list[list[Detection]] = []
        for rows in self.batches(len(pil)):
            raw = self.detector(pil[rows], [classes(m) for m in metadata[rows]])
            found += [select(r, thresholds.counting if m.get("tag") == "counting" else thresholds.score,
                             o.max_objects, o.max_overlap) for r, m in zip(raw, metadata[rows])]
        wanted = [(i, d) for i, (m, f) in enumerate(zip(metadata, found)) for d in to_colour(m, f)]
        named = self.colours([crop(pil[i], d.box) for i, d in wanted], [d.label for _, d in wanted])
        colour: list[dict[Detection, str]] = [{} for _ in pil]
        for (i, d), name in zip(wanted, named):
            colour[i][d] = name
        return [(m, f, colour[i].__getitem__) for i, (m, f) in enumerate(zip(metadata, found))]
