"""`ocr`: how well the image spells the text the prompt quotes, as Flow-GRPO's OCR reward.

Flow-GRPO's OCR prompts quote the text to render (`... a sign that reads "OPEN 24 HOURS"`). Its
reward (github yifan123/flow_grpo at ac4c86e, `flow_grpo/ocr.py` `OcrScorer`, with paddleocr 2.9.1
as its README installs), replicated by `quoted` and `ocr_reward`:

- l.31: the target is the text between the prompt's first two double quotes, `prompt.split('"')[1]`;
- l.44: PaddleOCR (`PaddleOCR(use_angle_cls=False, lang="en")`, `ocr(img, cls=False)`) detects text
  boxes, reads each, and the readings (with confidence > 0, after PaddleOCR's own drop of those
  under 0.5) are joined without separators, boxes top to bottom then left to right;
- l.46-47: the text read and the target are lowercased and their spaces (' ' only) removed;
- l.48-51: distance 0 if the target occurs anywhere in what was read, else their Levenshtein distance;
- l.53-54: the distance is clipped at the target's length ("only add one character penalty" for
  reading much unrelated text);
- l.56-59: a read that raises scores the full distance, i.e. 0;
- l.60: reward = 1 - distance / len(target), so in [0, 1].

The reader (`reader`):

- `rapidocr` (the default): PaddleOCR's PP-OCRv4 text detection (DB) and recognition (SVTR-LCNet,
  CTC) as ONNX models run by `rapidocr-onnxruntime` 1.4.4 on the CPU (as Flow-GRPO runs PaddleOCR,
  `use_gpu=False`); the wheel ships the weights, so it reads offline. Set as PaddleOCR 2.9.1 reads
  (tools/infer/utility.py and predict_det.py): no angle classifier, detector thresholds 0.3 / box
  0.6, unclip ratio 1.5, no dilation, ImageNet mean and std, readings under 0.5 dropped. The image
  is handed over as Flow-GRPO hands it, an RGB array that both libraries read as BGR.
  Where it differs: the wheel's models are PP-OCRv4's Chinese-English ones (`ch_PP-OCRv4_det`,
  `ch_PP-OCRv4_rec`, a 6,623-character dictionary), where `lang="en"` loads `en_PP-OCRv3_det` and
  `en_PP-OCRv4_rec` (English letters, digits and symbols); `det_model` and `rec_model` take those,
  converted to ONNX (PaddleOCRModelConvert writes the dictionary into the model). Images larger
  than 960 px are read at up to 1500 px (rapidocr picks the limit by size), where PaddleOCR shrinks
  them to 960. Recognition batches the text boxes of one image; images are read one at a time.
- `trocr`: a `transformers` vision-encoder-decoder OCR model (`model`, by default
  microsoft/trocr-base-printed; greedy, one `generate` per batch). TrOCR has no detector: it reads
  the whole image, resized to its input, as one line of text, so it suits images where the text
  fills the frame and under-reads text that is small in a scene.

A prompt without quotes (Flow-GRPO: IndexError at l.31) is refused with a ValueError naming it
(`unquoted: zero` scores it 0 instead), and so is an empty quote (ZeroDivisionError at l.60). A
read that fails on one image (the rapidocr reader) scores 0, as in Flow-GRPO, and is logged.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch
from pydantic import Field, NonNegativeInt, model_validator

from common.hub import local_model
from common.loading import pretrained
from tasks.base import Refinement, to_uint8
from tasks.rewards.base import Options, RewardModel, pil_images

LOG = logging.getLogger("jointrl.reward")
TROCR_MODEL = "microsoft/trocr-base-printed"
# PaddleOCR 2.9.1's text detector (tools/infer/utility.py defaults, predict_det.py normalisation) and
# its drop_score, in rapidocr-onnxruntime's parameter names
PADDLEOCR = {"det_thresh": 0.3, "det_box_thresh": 0.6, "det_unclip_ratio": 1.5, "det_use_dilation": False,
             "det_score_mode": "fast", "det_limit_side_len": 960, "det_limit_type": "max",
             "det_mean": [0.485, 0.456, 0.406], "det_std": [0.229, 0.224, 0.225], "text_score": 0.5}


def quoted(prompt: str) -> str:
    """The text the prompt asks to render: between its first two double quotes (Flow-GRPO l.31)."""
    parts = prompt.split('"')
    if len(parts) < 2:
        raise ValueError(f'the ocr reward needs the text to render in double quotes; this prompt has none: {prompt!r}')
    return parts[1]


def levenshtein(a: str, b: str) -> int:
    """The edit distance (insertions, deletions, substitutions of one character each), as
    `Levenshtein.distance` that Flow-GRPO calls."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def ocr_reward(target: str, read: str) -> float:
    """1 - (clipped) edit distance / target length, after lowercasing and removing spaces (Flow-GRPO
    l.46-60; see the module docstring)."""
    target, read = target.replace(" ", "").lower(), read.replace(" ", "").lower()
    if not target:
        raise ValueError("the ocr reward's quoted text is empty (or only spaces): there is nothing to read")
    distance = 0 if target in read else min(levenshtein(read, target), len(target))
    return 1 - distance / len(target)


class OCROptions(Options):
    reader: Literal["rapidocr", "trocr"] = Field("rapidocr", description="rapidocr: PaddleOCR's PP-OCRv4 "
                                                 "detection and recognition (ONNX, CPU, weights in the "
                                                 "rapidocr-onnxruntime wheel), as Flow-GRPO reads; trocr: a "
                                                 "transformers OCR model (`model`) reading the whole image as "
                                                 "one line")
    det_model: str | None = Field(None, description="rapidocr: the text detector's ONNX file; None: the wheel's "
                                                    "ch_PP-OCRv4_det (PaddleOCR lang=en: en_PP-OCRv3_det)")
    rec_model: str | None = Field(None, description="rapidocr: the recogniser's ONNX file, its dictionary in its "
                                                    "metadata; None: the wheel's ch_PP-OCRv4_rec (PaddleOCR lang=en: "
                                                    "en_PP-OCRv4_rec)")
    threads: NonNegativeInt = Field(0, description="rapidocr: onnxruntime threads per model; 0: its default "
                                                   "(one per core)")
    max_new_tokens: int = Field(32, ge=1, description="trocr: the most tokens the model reads per image")
    unquoted: Literal["error", "zero"] = Field("error", description="a prompt without quoted text: error (its "
                                               "sample is dropped, counted as a reward error) or zero (it scores 0; "
                                               "for prompt sets that mix text and other prompts)")

    @model_validator(mode="after")
    def _reader_keys(self):
        """Each reader's own keys only: a model named for the other reader would be silently unused."""
        if self.reader == "rapidocr" and self.model is not None:
            raise ValueError(f"model={self.model!r} names a transformers OCR model, read with reader=trocr; the "
                             f"rapidocr reader's models are det_model and rec_model (ONNX files)")
        if self.reader == "trocr" and (self.det_model or self.rec_model):
            raise ValueError("det_model and rec_model are the rapidocr reader's ONNX files; reader=trocr reads "
                             "with `model`")
        return self


class RapidOCRReader:
    """PP-OCRv4 through rapidocr-onnxruntime, set as PaddleOCR 2.9.1 reads (see the module docstring)."""

    def __init__(self, options: OCROptions):
        from rapidocr_onnxruntime import RapidOCR
        models = {"det_model_path": options.det_model, "rec_model_path": options.rec_model}
        for key, path in models.items():
            if path is not None and not Path(path).is_file():
                raise ValueError(f"ocr: no ONNX file at {path!r} ({key.removesuffix('_path')})")
        self.engine = RapidOCR(**PADDLEOCR, use_cls=False, intra_op_num_threads=options.threads or -1,
                               inter_op_num_threads=options.threads or -1,
                               **{k: v for k, v in models.items() if v is not None})

    def read(self, images: np.ndarray) -> list[str | None]:
        """What is read in each image (B, 3, H, W) in [-1, 1], its boxes' texts joined; None where
        reading raised (Flow-GRPO scores it 0)."""
        out: list[str | None] = []
        for image in images:
            try:
                found, _ = self.engine(to_uint8(np.asarray(image, dtype=np.float32)))
                out.append("".join(text for _, text, _ in found or []))
            except Exception as e:  # Flow-GRPO l.56-59: any failure of a read is a zero, not a stop
                LOG.warning("ocr: reading an image failed, scored 0 (%s: %s)", type(e).__name__, e)
                out.append(None)
        return out


class TrOCRReader:
    """A `VisionEncoderDecoderModel` (TrOCR) reading each whole image as one line, greedily, one
    `generate` per batch of `batch_size`."""

    def __init__(self, model: str, options: OCROptions, dtype: torch.dtype, device: torch.device):
        from transformers import AutoProcessor, VisionEncoderDecoderModel
        path = local_model(model, options.revision)
        self.processor = AutoProcessor.from_pretrained(path)
        self.model = pretrained(VisionEncoderDecoderModel, path, dtype, device).eval().requires_grad_(False)
        self.options, self.dtype, self.device = options, dtype, device

    @torch.no_grad()
    def read(self, images: np.ndarray) -> list[str]:
        texts, size = [], self.options.batch_size
        for start in range(0, len(images), size):
            pixels = self.processor(images=pil_images(images[start:start + size]), return_tensors="pt")["pixel_values"]
            tokens = self.model.generate(pixels.to(self.device, self.dtype), do_sample=False, num_beams=1,
                                         max_new_tokens=self.options.max_new_tokens)
            texts += self.processor.batch_decode(tokens, skip_special_tokens=True)
        return texts


class OCR(RewardModel):
    """Flow-GRPO's OCR reward, read by PP-OCRv4 (rapidocr) or a TrOCR model (see the module docstring)."""
    Options = OCROptions

    def __init__(self, options: OCROptions, device: torch.device):
        super().__init__(options, device)
        self.reader = RapidOCRReader(options) if options.reader == "rapidocr" else \
            TrOCRReader(self.model_name, options, self.dtype, device)

    @classmethod
    def imports(cls, options: OCROptions) -> tuple[str, ...]:
        return ("rapidocr_onnxruntime",) if options.reader == "rapidocr" else ("transformers",)

    @classmethod
    def named_model(cls, options: OCROptions) -> str | None:
        """The transformers model the trocr reader loads; None for rapidocr (ONNX files, not a checkpoint)."""
        return (options.model or TROCR_MODEL) if options.reader == "trocr" else None

    def read(self, images: np.ndarray) -> list[str | None]:
        return self.reader.read(images)

    def __call__(self, images: np.ndarray, prompts: Sequence[Any],
                 refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        asked = [('"' in p.text) or self.options.unquoted == "error" for p in prompts]
        targets = [quoted(p.text) if a else "" for p, a in zip(prompts, asked)]  # a bad prompt fails fast
        out = np.zeros(len(prompts))
        rows = [i for i, a in enumerate(asked) if a]
        if rows:
            read = self.read(images[rows])
            out[rows] = [0.0 if text is None else ocr_reward(targets[i], text) for i, text in zip(rows, read)]
        return out
