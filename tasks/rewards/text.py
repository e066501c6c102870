"""Text terms: they judge a refinement on its own, for any task, and a refiner can own them.

Each reads the composed refinement of the refiners that own the term (tasks/rewards/base.py
`merged`); an unrefined sample scores 0, so under shared credit the group's unrefined samples are
the baseline a refinement has to beat.

- `format`: PromptRL's format reward (arXiv 2602.01382 sec. 3.2): 1 if the refiner answered in the
  format it was asked for (an `<answer>…</answer>` tag, `experts.refiner_<i>.answer_tag`), with a
  non-empty answer, and stopped by itself; else 0.
- `length`: a length budget: 1 up to `budget` words (or tokens of `tokenizer`, e.g. the generator's
  CLIP tokenizer with its 77-token window), falling linearly to 0 at twice the budget.
- `faithful`: the refinement keeps the original prompt's content. With GenEval metadata, the
  fraction of the prompt's objects, counts (> 1) and colours it names; otherwise the fraction of the
  prompt's content words it keeps, or, with a `model`, the cosine similarity of the two texts'
  embeddings (a CLIP text tower, or any encoder whose last hidden states are mean-pooled).
"""
from __future__ import annotations

import re

import numpy as np
import torch
from pydantic import Field

from common.hub import ModelRef
from tasks.base import Refinement
from tasks.rewards.base import Options, RewardModel, merged

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
STOP_WORDS = frozenset("a an the of and or with in on at to for by from is are be this that it its as photo "
                       "picture image".split())


def words(text: str) -> list[str]:
    """Lower-case words and numbers (punctuation dropped)."""
    return re.findall(r"[0-9a-z]+", text.lower())


class TextTerm(RewardModel):
    needs_images = False

    def score(self, ref: Refinement, prompt) -> float:
        raise NotImplementedError

    def __call__(self, images, prompts, refinements) -> np.ndarray:
        out = np.zeros(len(prompts))
        for i, (prompt, refs) in enumerate(zip(prompts, refinements)):
            ref = merged(refs)
            out[i] = 0.0 if ref is None else self.score(ref, prompt)
        return out


class FormatOptions(Options):
    require_end: bool = Field(True, description="also require that the refiner stopped by itself (not cut off "
                                                "at max_new_tokens)")


class Format(TextTerm):
    Options = FormatOptions

    def score(self, ref: Refinement, prompt) -> float:
        return float(ref.formatted is not False and bool(ref.words) and (ref.ended or not self.options.require_end))


class LengthOptions(Options):
    budget: int = Field(60, ge=1, description="words (or tokens of `tokenizer`) for full credit; 0 credit at "
                                              "twice as many")
    tokenizer: str | None = Field(None, description="count tokens of this tokenizer (a folder, hub id or "
                                                    "tiny:<kind>) instead of words")


class Length(TextTerm):
    Options = LengthOptions

    def __init__(self, options: LengthOptions, device: torch.device):
        super().__init__(options, device)
        self.tokenizer = None
        if options.tokenizer:
            from transformers import AutoTokenizer

            from common.hub import local_model
            self.tokenizer = AutoTokenizer.from_pretrained(local_model(options.tokenizer, weights=False))

    @classmethod
    def models(cls, options: LengthOptions) -> list[ModelRef]:
        return [ModelRef(options.tokenizer, weights=False, option="tokenizer")] if options.tokenizer else []

    def size(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score(self, ref: Refinement, prompt) -> float:
        n, budget = self.size(ref.text), self.options.budget
        return 0.0 if n == 0 else float(np.clip(2.0 - n / budget, 0.0, 1.0))


def geneval_recall(said: set[str], metadata: dict) -> float:
    """Fraction of the GenEval clauses' objects, counts (> 1, as a word or a digit) and colours
    that the refinement names (a plural object counts)."""
    wanted = []
    for clause in metadata["include"]:
        name = words(str(clause["class"]))
        wanted.append(all(w in said or w + "s" in said or w + "es" in said for w in name))
        count = int(clause.get("count") or 1)
        if count > 1:
            wanted.append(str(count) in said or (count < len(NUMBER_WORDS) and NUMBER_WORDS[count] in said))
        if clause.get("color"):
            wanted.append(str(clause["color"]).lower() in said)
    return sum(wanted) / len(wanted) if wanted else 0.0


def word_recall(said: set[str], prompt_text: str) -> float:
    """Fraction of the prompt's content words (stop words aside) the refinement keeps."""
    content = {w for w in words(prompt_text) if w not in STOP_WORDS}
    return len(content & said) / len(content) if content else 1.0


class FaithfulOptions(Options):
    use_metadata: bool = Field(True, description="score GenEval prompts (with `include`) by the clauses they "
                                                 "name; false: as any other prompt")


class Faithful(TextTerm):
    Options = FaithfulOptions

    def __init__(self, options: FaithfulOptions, device: torch.device):
        super().__init__(options, device)
        self.tokenizer = self.encoder = None
        if options.model:
            from transformers import AutoModel, AutoTokenizer

            from common.hub import local_model
            from common.loading import pretrained
            path = local_model(options.model, options.revision)
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.encoder = pretrained(AutoModel, path, self.dtype, device).eval()

    @torch.no_grad()
    def embed(self, texts: list[str]) -> torch.Tensor:
        batch = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(self.device)
        if hasattr(self.encoder, "get_text_features"):
            out = self.encoder.get_text_features(**batch)
            out = out if isinstance(out, torch.Tensor) else out.pooler_output
        else:
            hidden = self.encoder(**batch).last_hidden_state
            mask = batch["attention_mask"][..., None].to(hidden.dtype)
            out = (hidden * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.normalize(out.float(), dim=-1)

    def by_clauses(self, prompt) -> bool:
        return self.options.use_metadata and bool(prompt.metadata.get("include"))

    def score(self, ref: Refinement, prompt) -> float:
        if not ref.words:
            return 0.0
        if self.by_clauses(prompt):
            return geneval_recall(set(words(ref.text)), prompt.metadata)
        return word_recall(set(words(ref.text)), prompt.text)

    def __call__(self, images, prompts, refinements) -> np.ndarray:
        """With a `model`, the cosines of the batch's prompt and refinement embeddings in one pass."""
        out = super().__call__(images, prompts, refinements)
        if self.encoder is None:
            return out
        pairs = [(i, p.text, ref.text) for i, (p, refs) in enumerate(zip(prompts, refinements))
                 if (ref := merged(refs)) is not None and ref.words and not self.by_clauses(p)]
        if pairs:
            rows, texts = [i for i, _, _ in pairs], [t for _, a, b in pairs for t in (a, b)]
            embedded = self.embed(texts)
            out[rows] = torch.clamp((embedded[0::2] * embedded[1::2]).sum(-1), 0.0, 1.0).cpu().numpy()
        return out
