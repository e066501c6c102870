"""A tiny causal-transformer refiner LM over the task's word vocabulary.

The refiner interface the driver relies on, which a Hugging Face causal LM also offers
(experts/hf_refiner.py): `prompt_ids` (a prompt as the model's context), `sample` (tokens and their
log-probs under the sampling temperature), `token_logprobs` (the same log-probs recomputed with
gradients, for the update) and `refinement` (what the tokens contribute to the prompt).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from experts.layers import Trunk, causal_mask
from tasks.base import Refinement, Vocabulary


def left_pad(seqs: list[list[int]], pad: int) -> torch.Tensor:
    n = max(len(s) for s in seqs)
    return torch.tensor([[pad] * (n - len(s)) + list(s) for s in seqs], dtype=torch.long)


class TinyCausalLM(Trunk):
    """A word-level causal LM over the words of `vocab` (it never writes <pad>, <bos> or <sep>)."""

    def __init__(self, vocab: Vocabulary, d_model: int, n_layers: int, n_heads: int, *, max_len: int,
                 max_new_tokens: int, temperature: float):
        super().__init__(len(vocab.words), d_model, n_layers, n_heads, max_len=max_len)
        self.vocab = vocab
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.head = nn.Linear(d_model, len(vocab.words))
        banned = torch.zeros(len(vocab.words), dtype=torch.bool)
        banned[[vocab.pad, vocab.bos, vocab.sep]] = True
        self.register_buffer("banned", banned, persistent=False)

    def logprobs(self, seq: torch.Tensor, keep: int) -> torch.Tensor:
        """Next-token log-probs (B, keep, V) at the last `keep` positions of left-padded `seq`, at
        temperature; the head runs only there."""
        pad = seq == self.vocab.pad
        pos = ((~pad).cumsum(1) - 1).clamp(min=0)
        logits = self.head(self.trunk(seq, pos, causal_mask(pad))[:, seq.shape[1] - keep:]) / self.temperature
        return F.log_softmax(logits.masked_fill(self.banned, float("-inf")), dim=-1)

    def context(self, prompts: list[list[int]]) -> torch.Tensor:
        v = self.vocab
        return left_pad([[v.bos, *p, v.sep] for p in prompts], v.pad).to(self.head.weight.device)

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], uniforms: torch.Tensor):
        """Sample up to max_new_tokens per prompt by inverse CDF of `uniforms` (B, M).

        Returns tokens (B, M) with PAD after EOS, their log-probs (B, M) and a validity mask (B, M).
        """
        seq = self.context(prompts)
        b, m = len(prompts), self.max_new_tokens
        done = torch.zeros(b, dtype=torch.bool, device=seq.device)
        tokens, logps, mask = [], [], []
        for j in range(m):
            lp = self.logprobs(seq, 1)[:, -1]
            cdf = lp.exp().cumsum(-1)
            tok = torch.searchsorted(cdf, uniforms[:, j:j + 1] * cdf[:, -1:]).squeeze(1).clamp(max=lp.shape[-1] - 1)
            valid = ~done
            tok = torch.where(valid, tok, torch.full_like(tok, self.vocab.pad))
            tokens.append(tok)
            logps.append(torch.where(valid, lp.gather(1, tok[:, None]).squeeze(1), 0.0))
            mask.append(valid)
            done = done | (tok == self.vocab.eos)
            seq = torch.cat([seq, tok[:, None]], 1)
        return torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(mask, 1)

    def prompt_ids(self, prompt) -> list[int]:
        """A prompt record's words as this model reads them (words outside its vocabulary are left out)."""
        return self.vocab.encode(prompt.text.split(), self.vocab.max_prompt_words)

    def refinement(self, tokens: list[int], mask: list[bool]) -> Refinement:
        """The words of the tokens before the end, and whether the model ended them itself."""
        return Refinement(" ".join(self.vocab.decode(tokens)), self.vocab.eos in tokens)

    def token_logprobs(self, prompts: list[list[int]], tokens: torch.Tensor, mask=None) -> torch.Tensor:
        """Log-probs (B, M) of the sampled `tokens` given their prompts, with gradients (after the
        end, PAD tokens mark what `mask` says, and score 0)."""
        seq = torch.cat([self.context(prompts), tokens[:, :-1]], 1)  # the last token predicts nothing scored
        lp = self.logprobs(seq, tokens.shape[1])
        return torch.where(tokens == self.vocab.pad, 0.0, lp.gather(2, tokens[:, :, None]).squeeze(2))
