"""A Hugging Face causal LM as a refiner (`experts.refiners[*].model.kind=hf_causal_lm`).

It stands behind the same interface as `TinyCausalLM`: `prompt_ids` (the chat-templated context
of a prompt), `sample` (tokens drawn by inverse CDF of given uniforms, so that runs repeat exactly,
and their log-probs at the sampling temperature), `token_logprobs` (the same log-probs recomputed
with gradients, for the generated tokens only) and `refinement` (the text a refiner contributes:
what it wrote inside `<answer>…</answer>`, with whether it kept to that format, as PromptRL asks).

With `lora`, peft wraps the model: only the adapter trains, the frozen reference is the same model
with the adapter disabled (no second copy of the weights), and only adapter weights are synced and
checkpointed (`synced_state`). `ChatRefiner` holds what it shares with a refiner a vLLM engine
samples on the rollout workers (experts/vllm_refiner.py): the text in and out, and what a version is.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from common.hub import local_model
from common.loading import DTYPES, load_tokenizer, pretrained
from tasks.base import Refinement

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # a causal LM's attention projections


def answer_of(text: str, tag: str | None) -> tuple[str, bool | None]:
    """(the refinement, whether the text kept to the answer format; None without a tag)."""
    if tag is None:
        return text.strip(), None
    found = re.search(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return (found.group(1).strip(), True) if found else ("", False)


def with_adapter(lm, lora, seed: int):
    """`lm` wrapped by peft with a LoRA adapter of `lora` (an experts' LoraConfig), initialised from
    `seed`: identical wherever it is built."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    return get_peft_model(lm, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                         target_modules=lora.target_modules or LORA_TARGETS))


class ChatRefiner(nn.Module):
    """A chat LM refiner however it is sampled (its `spec` is the model section, its `tokenizer`
    the model's, its `lm` the model as the trainer holds it): the templated context of a prompt,
    the refinement its tokens make, and what a version of it consists of."""

    @property
    def lora(self) -> bool:
        return self.spec.lora is not None

    def synced_state(self) -> dict[str, torch.Tensor]:
        """What a new version consists of: the adapter's weights with LoRA, else every weight."""
        state = self.state_dict()
        return {k: v for k, v in state.items() if "lora_" in k} if self.lora else state

    def special_ids(self, config_eos: int | None) -> None:
        eos = self.tokenizer.eos_token_id
        self.eos = eos if eos is not None else config_eos
        pad = self.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.eos

    def chat_ids(self, text: str) -> list[int]:
        """The chat-templated context of a prompt: system prompt, user prompt, assistant turn."""
        messages = [{"role": "user", "content": text}]
        if self.spec.system_prompt:
            messages.insert(0, {"role": "system", "content": self.spec.system_prompt})
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def prompt_ids(self, prompt) -> list[int]:  # a task's prompt object: its text is what the LM reads
        return self.chat_ids(prompt.text)

    def refinement(self, tokens: list[int], mask: list[bool]) -> Refinement:
        """The words of its answer, whether it ended by itself, whether it kept to the answer format."""
        kept = [t for t, v in zip(tokens, mask) if v and t != self.eos]
        ended = any(t == self.eos for t, v in zip(tokens, mask) if v)
        text, formatted = answer_of(self.tokenizer.decode(kept, skip_special_tokens=True), self.spec.answer_tag)
        return Refinement(" ".join(text.split()), ended, formatted)


class HFRefiner(ChatRefiner):
    def __init__(self, spec, seed: int, device: torch.device = torch.device("cpu")):
        super().__init__()
        from transformers import AutoModelForCausalLM
        m = spec.model
        self.spec, self.max_new_tokens, self.temperature = m, spec.max_new_tokens, spec.temperature
        path = local_model(m.path, m.revision)
        self.tokenizer = load_tokenizer(path)
        self.lm = pretrained(AutoModelForCausalLM, path, DTYPES[m.dtype], device)
        if m.lora:
            self.lm = with_adapter(self.lm, m.lora, seed)
        self.special_ids(self.lm.config.eos_token_id)

    def left_pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        n = max(len(s) for s in seqs)
        device = self.lm.device
        ids = torch.tensor([[self.pad] * (n - len(s)) + list(s) for s in seqs], dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long, device=device)
        return ids, mask

    def step_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(logits.float() / self.temperature, dim=-1)

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], uniforms: torch.Tensor):
        """Up to max_new_tokens per context by inverse CDF of `uniforms` (B, M), with a KV cache.
        Returns tokens (B, M) (pad after the end), their log-probs (B, M) and a validity mask (B, M)."""
        ids, attention = self.left_pad(prompts)
        b = len(prompts)
        done = torch.zeros(b, dtype=torch.bool, device=ids.device)
        tokens, logps, masks = [], [], []
        out = self.lm(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
                      use_cache=True, logits_to_keep=1)  # the LM head at the last position only
        for j in range(self.max_new_tokens):
            lp = self.step_logprobs(out.logits[:, -1])
            cdf = lp.exp().cumsum(-1)
            tok = torch.searchsorted(cdf, uniforms[:, j:j + 1] * cdf[:, -1:]).squeeze(1).clamp(max=lp.shape[-1] - 1)
            valid = ~done
            tok = torch.where(valid, tok, torch.full_like(tok, self.pad))
            tokens.append(tok)
            logps.append(torch.where(valid, lp.gather(1, tok[:, None]).squeeze(1), 0.0))
            masks.append(valid)
            done = done | (tok == self.eos)
            if j + 1 == self.max_new_tokens or done.all():
                break
            attention = torch.cat([attention, valid[:, None].long()], 1)
            cache = {"cache": out.cache} if "cache" in out else {"past_key_values": out.past_key_values}  # v5 / v4
            out = self.lm(input_ids=tok[:, None], attention_mask=attention,
                          position_ids=(attention.sum(1, keepdim=True) - 1), use_cache=True, **cache)
        pad = self.max_new_tokens - len(tokens)
        tokens = torch.stack(tokens, 1)
        return (F.pad(tokens, (0, pad), value=self.pad), F.pad(torch.stack(logps, 1), (0, pad)),
                F.pad(torch.stack(masks, 1), (0, pad), value=False))

    def token_logprobs(self, prompts: list[list[int]], tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Log-probs (B, M) of the generated `tokens` (where `mask`), with gradients; 0 elsewhere.
        The LM head and the fp32 log-softmax run only at the M positions that predict them (the
        context's last and each generated token's but the last, which predicts nothing scored):
        at a real vocabulary the logits of every position would dwarf the rest of the update."""
        ids, attention = self.left_pad(prompts)
        seq = torch.cat([ids, tokens[:, :-1]], 1)
        attention = torch.cat([attention, mask[:, :-1].long()], 1)
        logits = self.lm(input_ids=seq, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
                         use_cache=False, logits_to_keep=tokens.shape[1]).logits
        lp = self.step_logprobs(logits)
        return torch.where(mask, lp.gather(2, tokens[:, :, None]).squeeze(2), 0.0)

    def adapter_disabled(self):
        """A context in which this model is its frozen base (LoRA): the reference, without a copy."""
        return self.lm.disable_adapter()
