"""Open-vocabulary detectors for the geneval reward: OWLv2 and Grounding DINO from `transformers`,
one forward per batch of images, each image asked for its own prompt's classes, their boxes as
`Detection` records; and GenEval's per-class selection of boxes (threshold, cap, overlap).

References: github djghosh13/geneval at af4902f, `evaluation/evaluate_images.py` (cited by line);
tasks/rewards/geneval.py says how these differ from GenEval's Mask2Former.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from common.hub import local_model
from common.loading import pretrained

DEFAULT_MODELS = {"owlv2": "google/owlv2-base-patch16-ensemble", "grounding_dino": "IDEA-Research/grounding-dino-tiny"}
MODEL_TYPES = {"owlv2": "owlv2", "grounding-dino": "grounding_dino"}  # a config's model_type -> detector
QUERY_TEMPLATES = {"owlv2": "a photo of a {}", "grounding_dino": "{}"}

Box = tuple[float, float, float, float]  # (x0, y0, x1, y1) in pixels


@dataclass(frozen=True)
class Detection:
    """One detected object: the prompt class it was matched to, the detector's score, its box."""
    label: str
    score: float
    box: Box


def ranked(detections: Sequence[Detection]) -> dict[str, list[Detection]]:
    """Detections by label, most confident first (GenEval checks colour and position on the most
    confident `count` objects of a class, `evaluate` l.176)."""
    out: dict[str, list[Detection]] = {}
    for d in sorted(detections, key=lambda d: -d.score):
        out.setdefault(d.label, []).append(d)
    return out


def iou(a: Box, b: Box) -> float:
    """Intersection over union with GenEval's inclusive pixel convention (`compute_iou`, l.130-137)."""
    area = lambda x0, y0, x1, y1: max(x1 - x0 + 1, 0) * max(y1 - y0 + 1, 0)
    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a) + area(*b) - inter
    return inter / union if union else 0.0


def select(detections: Sequence[Detection], threshold: float, max_objects: int,
           max_overlap: float) -> list[Detection]:
    """Per class, as GenEval keeps boxes (l.230-242): the most confident first, those scoring above
    `threshold`, at most `max_objects`, each dropped that overlaps a kept one by `max_overlap` or
    more (IoU; 1 keeps all)."""
    kept: list[Detection] = []
    for objects in ranked(detections).values():
        queue = [d for d in objects if d.score > threshold][:max_objects]
        while queue:
            best = queue.pop(0)
            kept.append(best)
            queue = [d for d in queue if max_overlap >= 1 or iou(best.box, d.box) < max_overlap]
    return kept


def corners(boxes: torch.Tensor) -> torch.Tensor:
    """(cx, cy, w, h) -> (x0, y0, x1, y1), as the detectors' heads predict and processors convert."""
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def owl_detections(logits: torch.Tensor, pred_boxes: torch.Tensor, queries: Sequence[Sequence[str]],
                   sizes: Sequence[tuple[int, int]]) -> list[list[Detection]]:
    """Every box of each image with its best query among that image's own and the sigmoid of that
    logit, in pixels of the image (h, w): OWLv2 boxes are relative to the square the image was
    padded to (transformers `Owlv2ImageProcessor.post_process_object_detection`, which also takes
    the best over the query slots a batch pads with; these are left out here)."""
    out = []
    for image_logits, boxes, labels, (h, w) in zip(logits.float(), pred_boxes.float(), queries, sizes):
        best = image_logits[:, :len(labels)].max(-1)
        out.append(_records(labels, torch.sigmoid(best.values), best.indices, corners(boxes) * max(h, w)))
    return out


def grounding_detections(logits: torch.Tensor, pred_boxes: torch.Tensor, spans: Sequence[Sequence[list[int]]],
                         labels: Sequence[Sequence[str]], *, sizes: Sequence[tuple[int, int]]) -> list[list[Detection]]:
    """Every box of each image with its best class, a class scoring the best sigmoid over its own
    tokens `spans` (Grounding DINO scores boxes against text tokens; transformers'
    `post_process_grounded_object_detection` takes the best over all tokens, separators included,
    and names the tokens above a threshold rather than a class)."""
    out = []
    for image_logits, boxes, image_spans, image_labels, (h, w) in zip(logits.float(), pred_boxes.float(), spans,
                                                                      labels, sizes):
        probs = torch.sigmoid(image_logits)
        per_class = torch.stack([probs[:, span].max(-1).values for span in image_spans], dim=-1)
        best = per_class.max(-1)
        scale = torch.tensor([w, h, w, h], dtype=boxes.dtype)
        out.append(_records(image_labels, best.values, best.indices, corners(boxes) * scale))
    return out


def _records(labels: Sequence[str], scores: torch.Tensor, indices: torch.Tensor,
             boxes: torch.Tensor) -> list[Detection]:
    return [Detection(labels[i], s, tuple(b)) for i, s, b in zip(indices.tolist(), scores.tolist(), boxes.tolist())]


class OwlV2:
    """OWLv2 (Minderer et al. 2023) through `Owlv2ForObjectDetection`: one forward per batch of
    images, each with its own prompt's class queries (the processor pads them to the most)."""
    kind = "owlv2"

    def __init__(self, processor, model, template: str):
        self.processor, self.model, self.template = processor, model, template

    def square(self, image):
        """The image padded to a square at the bottom right, in black, and resized to the model's
        input (see the module docstring: the processor's own resize needs scipy)."""
        from PIL import Image
        side, size = max(image.size), self.processor.image_processor.size
        padded = Image.new("RGB", (side, side))
        padded.paste(image, (0, 0))
        return padded.resize((size["width"], size["height"]), Image.Resampling.BILINEAR)

    def encode(self, images: Sequence, queries: Sequence[Sequence[str]]) -> dict[str, torch.Tensor]:
        """The model's inputs for PIL `images`, each with its own class names `queries`."""
        inputs = self.processor(images=[self.square(im) for im in images],
                                text=[[self.template.format(q) for q in qs] for qs in queries],
                                images_kwargs={"do_resize": False}, return_tensors="pt")
        device = self.model.device
        return {"input_ids": inputs["input_ids"].to(device), "attention_mask": inputs["attention_mask"].to(device),
                "pixel_values": inputs["pixel_values"].to(device, self.model.dtype)}

    @torch.no_grad()
    def __call__(self, images: Sequence, queries: Sequence[Sequence[str]]) -> list[list[Detection]]:
        outputs = self.model(**self.encode(images, queries))
        return owl_detections(outputs.logits, outputs.pred_boxes, queries, [im.size[::-1] for im in images])


class GroundingDino:
    """Grounding DINO (Liu et al. 2023) through `AutoModelForZeroShotObjectDetection`: one forward
    per batch of images, each with its own prompt's classes as one text, "cat. dog." (lower case,
    each phrase ended by a dot, as the model was trained and its processor merges labels)."""
    kind = "grounding_dino"

    def __init__(self, processor, model, template: str):
        self.processor, self.model, self.template = processor, model, template

    def phrases(self, queries: Sequence[str]) -> list[str]:
        return [self.template.format(q).strip().lower() for q in queries]

    def tokens(self, queries: Sequence[Sequence[str]]):
        """Each image's classes as one text, tokenized as a batch."""
        texts = [" ".join(f"{p}." for p in self.phrases(qs)) for qs in queries]
        return self.processor.tokenizer(texts, padding=True, return_token_type_ids=True, return_tensors="pt")

    def encode(self, images: Sequence, queries: Sequence[Sequence[str]]) -> dict[str, torch.Tensor]:
        """The model's inputs for PIL `images`, each with its own class names `queries`."""
        pixels = self.processor.image_processor(images=list(images), return_tensors="pt")
        device = self.model.device
        return {**{k: v.to(device) for k, v in self.tokens(queries).items()},
                "pixel_values": pixels["pixel_values"].to(device, self.model.dtype),
                "pixel_mask": pixels["pixel_mask"].to(device)}

    def spans(self, queries: Sequence[Sequence[str]]) -> list[list[list[int]]]:
        """Per image, the token positions of each of its classes in its text."""
        text, out = self.tokens(queries), []
        for row, qs in enumerate(queries):
            start, image_spans = 0, []
            for phrase in self.phrases(qs):
                image_spans.append(sorted({text.char_to_token(row, c) for c in range(start, start + len(phrase))}
                                          - {None}))
                start += len(phrase) + 2  # the dot and the space
            out.append(image_spans)
        return out

    @torch.no_grad()
    def __call__(self, images: Sequence, queries: Sequence[Sequence[str]]) -> list[list[Detection]]:
        outputs = self.model(**self.encode(images, queries))
        return grounding_detections(outputs.logits, outputs.pred_boxes, self.spans(queries), queries,
                                    sizes=[im.size[::-1] for im in images])


DETECTORS = {"owlv2": OwlV2, "grounding_dino": GroundingDino}


def load_detector(name: str, detector: str | None, template: str | None, dtype: torch.dtype,
                  *, device: torch.device, revision: str | None = None) -> OwlV2 | GroundingDino:
    """The detector `name` names (at `revision`); its kind is read from its config (`detector`, if
    given, must agree)."""
    from transformers import AutoConfig, AutoModelForZeroShotObjectDetection, AutoProcessor
    path = local_model(name, revision)
    model_type = AutoConfig.from_pretrained(path).model_type
    found = MODEL_TYPES.get(model_type)
    if found is None or (detector is not None and detector != found):
        wanted = detector or " or ".join(DETECTORS)
        raise ValueError(f"geneval: the model '{name}' has model_type '{model_type}'; the detector must be {wanted} "
                         f"(model_type {' or '.join(t for t, d in MODEL_TYPES.items() if d in wanted)})")
    model = pretrained(AutoModelForZeroShotObjectDetection, path, dtype, device).eval()
    return DETECTORS[found](AutoProcessor.from_pretrained(path), model.requires_grad_(False),
                            template or QUERY_TEMPLATES[found])
