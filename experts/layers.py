"""The one transformer block the tiny models share (pre-norm attention + MLP, optional adaLN), and the
trunk of embeddings, blocks and final norm that the tiny LM and the text encoder are built on."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-LN transformer block. `allowed` is a boolean (B, L, L) mask of attendable keys.

    With `cond` (B, D) the block is adaLN-zero modulated (DiT): shift, scale and gate per sublayer.
    """

    def __init__(self, d: int, heads: int, adaln: bool = False):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d, elementwise_affine=not adaln)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=not adaln)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ada = nn.Linear(d, 6 * d) if adaln else None
        if adaln:
            nn.init.zeros_(self.ada.weight)
            nn.init.zeros_(self.ada.bias)

    def attn(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.proj(out.transpose(1, 2).reshape(b, n, d))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, cond: torch.Tensor | None = None):
        if self.ada is None:
            x = x + self.attn(self.norm1(x), allowed)
            return x + self.mlp(self.norm2(x))
        s1, m1, g1, s2, m2, g2 = self.ada(cond)[:, None].chunk(6, dim=-1)
        x = x + g1 * self.attn(self.norm1(x) * (1 + m1) + s1, allowed)
        return x + g2 * self.mlp(self.norm2(x) * (1 + m2) + s2)


class Trunk(nn.Module):
    """Token and position embeddings, `n_layers` blocks and a final LayerNorm.

    The tiny models derive from it (rather than hold it) so that their state-dict keys are
    `tok.*`, `pos.*`, `blocks.*`, `norm.*`, and their parameters are created in this order.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, *, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)

    def trunk(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Normed features (B, L, D) of `ids` at `positions` (broadcastable to ids), attending as
        the boolean (B, L, L) mask `allowed` says."""
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, allowed)
        return self.norm(x)


def causal_mask(pad: torch.Tensor) -> torch.Tensor:
    """Keys at or before the query that are not padding; a query always sees itself (no empty rows)."""
    n = pad.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=pad.device).tril()
    return (causal[None] & ~pad[:, None, :]) | torch.eye(n, dtype=torch.bool, device=pad.device)[None]


def padding_mask(pad: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention over non-padding keys; a query always sees itself."""
    n = pad.shape[1]
    return (~pad[:, None, :]).expand(-1, n, -1) | torch.eye(n, dtype=torch.bool, device=pad.device)[None]
