"""`vqa_score`: VQAScore, the probability a vision-language model answers "Yes" when asked whether
the image shows the prompt.

VQAScore (Lin et al. 2024, "Evaluating Text-to-Visual Generation with Image-to-Text Generation",
arXiv 2404.01291) scores an image against a text as P("Yes" | image, question(text)). Its reference
code for Qwen2-VL and Qwen2.5-VL (github linzhiqiu/t2v_metrics at 6ecb74f,
`t2v_metrics/models/vqascore_models/qwen2vl_model.py`, which now lists the Qwen2.5-VL checkpoints,
3B to 72B, and keeps Qwen2-VL's commented out) is followed; either family loads, picked by the
checkpoint's `model_type` (the reference picks by "qwen2.5" in the name):

- the question is `Does this figure show "{}"? Please answer Yes or No.` and the answer `Yes`
  (l.173-174; the paper's CLIP-FlanT5 template says "yes or no", V_3.0_README.md l.213), asked as
  one user turn, image first, in the model's chat template with the assistant turn opened (l.197-200);
- the score is the softmax over the whole vocabulary of the logits for the first answer token,
  taken at the "Yes" token (l.166, `_compute_token_prob`, at temperature 1): `over: vocabulary`,
  the default. `over: yes_no` renormalises over the "Yes" and "No" tokens instead, P(Yes) /
  (P(Yes) + P(No)), which ignores whatever else the model would say.

Where it differs: the reference runs `generate` for one token per image and reads its scores (after
the checkpoint's logits processors); here one forward pass per batch (left-padded, so the answer
position is the last one for every row) gives the raw next-token logits. The answer is scored by its
first token only (the reference takes the geometric mean over the answer's tokens, l.289); "Yes" is
one token in Qwen2's vocabulary, so the two agree there.

The inputs are made as `Qwen2VLProcessor` and `Qwen2_5_VLProcessor` make them (the two agree for
images: image tokens expanded to the image's merged patch grid, `mm_token_type_ids` marking them)
from the tokenizer and image processor: transformers 5 cannot build the processors themselves
without torchvision, which their video processor needs even for images (huggingface/transformers
#48558). tests/test_rewards_ocr_vqa.py checks them against both processors.
"""
from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np
import torch
from pydantic import Field, field_validator

from common.hub import local_model
from common.loading import pretrained
from tasks.base import Refinement
from tasks.rewards.base import Options, RewardModel, pil_images

QUESTION = 'Does this figure show "{prompt}"? Please answer Yes or No.'
ANSWERS = ("Yes", "No")
MODEL_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def yes_probability(logits: torch.Tensor, yes_id: int, no_id: int | None = None) -> torch.Tensor:
    """P(yes) from next-token logits (B, V): the softmax over the whole vocabulary at `yes_id`
    (VQAScore), or, given `no_id`, the softmax over the yes and no logits alone."""
    logits = logits.float()
    if no_id is None:
        return logits.softmax(-1)[:, yes_id]
    return logits[:, [yes_id, no_id]].softmax(-1)[:, 0]


class VQAScoreOptions(Options):
    question: str = Field(QUESTION, description="the question asked of each image; `{prompt}` is replaced by the "
                                                "original prompt (VQAScore's template for Qwen-VL by default)")
    over: Literal["vocabulary", "yes_no"] = Field("vocabulary", description="P(Yes) over the whole vocabulary "
                                                                            "(VQAScore) or over Yes and No only")

    @field_validator("question")
    @classmethod
    def _has_prompt(cls, question: str) -> str:
        """Checked with the config: `{prompt}` present and no other `{...}` (write `{{`, `}}` for braces)."""
        try:
            ok = question.format(prompt="\0") != question.format(prompt="")
        except (KeyError, IndexError, ValueError):
            ok = False
        if not ok:
            raise ValueError("the question must contain {prompt}, where the prompt goes, and no other {...}")
        return question


def model_class(name: str, path: str):
    """The `transformers` class of the Qwen-VL checkpoint at `path`, by its config's model_type."""
    import transformers
    from transformers import AutoConfig
    model_type = AutoConfig.from_pretrained(path).model_type
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"vqa_score: the model '{name}' has model_type '{model_type}'; vqa_score loads "
                         f"{' or '.join(MODEL_CLASSES)} (Qwen2-VL, Qwen2.5-VL)")
    return getattr(transformers, MODEL_CLASSES[model_type])


class VQAScore(RewardModel):
    """VQAScore with a Qwen2-VL or Qwen2.5-VL model (see the module docstring)."""
    Options = VQAScoreOptions
    default_model = "Qwen/Qwen2-VL-2B-Instruct"
    packages = ("transformers",)

    def __init__(self, options: VQAScoreOptions, device: torch.device):
        super().__init__(options, device)
        from transformers import AutoImageProcessor, AutoTokenizer
        path = local_model(self.model_name, options.revision)
        model = model_class(self.model_name, path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path)
        self.model = pretrained(model, path, self.dtype, device).eval().requires_grad_(False)
        self.yes_id, self.no_id = (self.tokenizer.encode(a, add_special_tokens=False)[0] for a in ANSWERS)
        if self.yes_id == self.no_id:
            raise ValueError(f"'{self.model_name}': Yes and No begin with the same token")

    def inputs(self, images: np.ndarray, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The model's inputs for a batch, left-padded, as the model's processor would make them."""
        image_id = self.model.config.image_token_id
        image_token = self.tokenizer.convert_ids_to_tokens(image_id)
        vision = self.image_processor(images=pil_images(images), return_tensors="pt")
        per_patch = self.image_processor.merge_size ** 2
        texts = []
        for prompt, grid in zip(prompts, vision["image_grid_thw"]):
            question = {"type": "text", "text": self.options.question.format(prompt=prompt)}
            chat = [{"role": "user", "content": [{"type": "image"}, question]}]
            text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            texts.append(text.replace(image_token, image_token * (int(grid.prod()) // per_patch), 1))
        tokens = self.tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
        return {**tokens, "mm_token_type_ids": (tokens["input_ids"] == image_id).long(),
                "pixel_values": vision["pixel_values"].to(self.dtype), "image_grid_thw": vision["image_grid_thw"]}

    @torch.no_grad()
    def __call__(self, images: np.ndarray, prompts: Sequence[Any],
                 refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        texts = [p.text for p in prompts]
        no_id = self.no_id if self.options.over == "yes_no" else None
        scores = np.empty(len(texts), dtype=np.float64)
        for rows in self.batches(len(texts)):
            inputs = {k: v.to(self.device) for k, v in self.inputs(images[rows], texts[rows]).items()}
            logits = self.model(**inputs, logits_to_keep=1).logits[:, -1]
            scores[rows] = yes_probability(logits, self.yes_id, no_id).cpu().numpy()
        return scores
