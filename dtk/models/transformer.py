"""The built-in decoder-only transformer (pre-norm, RMSNorm, SwiGLU, causal SDPA).

Module names are chosen for parallelism plans (conf/model/transformer.yaml names them):
`layers` is a ModuleDict keyed by the block index, so a pipeline stage can replace the
blocks it does not own and keep the original parameter names (checkpoints stay loadable
under any split); the embeddings, final norm and output head are None on stages that do
not hold them, and `forward` skips them. With model.num_experts > 0 (model=moe) each block's
feed-forward is top-k routed experts (dtk.models.moe).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtk.config.schema import TransformerConfig
from dtk.models.moe import MoE
from dtk.plan.shape import ffn_hidden_size  # the SwiGLU width: the planner's rule


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        # Context parallelism (dtk.parallel.cp): its layout, whose attention sees the keys of
        # the other cp ranks' slices of the sequence; None: causal attention over the input.
        self.cp: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 for the head count: under tensor parallelism this rank holds num_heads / tp heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        if self.cp is not None:
            out = self.cp.attention(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int, eps: float, dropout: float,
                 moe: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim, eps)
        self.attn = Attention(dim, num_heads)
        self.mlp_norm = RMSNorm(dim, eps)
        # model=moe: top-k routed experts (dtk.models.moe) instead of the one feed-forward
        self.mlp: nn.Module = MoE(dim, hidden, **moe) if moe else FeedForward(dim, hidden)
        # Identity at 0, not Dropout(0): a model without dropout draws no random numbers.
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x)))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int,
        dim: int,
        num_layers: int,
        num_heads: int,
        ffn_hidden: int,
        seq_len: int,
        norm_eps: float,
        dropout: float,
        tie_embeddings: bool,
        num_experts: int,
        top_k: int,
        aux_loss_weight: float,
        capacity_factor: float,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.num_layers = num_layers
        self.tok_embeddings: nn.Module | None = nn.Embedding(vocab_size, dim)
        self.pos_embeddings: nn.Module | None = nn.Embedding(seq_len, dim)
        hidden = ffn_hidden_size(dim, ffn_hidden)
        moe = dict(num_experts=num_experts, top_k=top_k, aux_loss_weight=aux_loss_weight,
                   capacity_factor=capacity_factor) if num_experts else None
        self.layers = nn.ModuleDict(
            {str(i): Block(dim, num_heads, hidden, norm_eps, dropout, moe) for i in range(num_layers)}
        )
        self.norm: nn.Module | None = RMSNorm(dim, norm_eps)
        self.output: nn.Module | None = nn.Linear(dim, vocab_size, bias=False)
        if tie_embeddings:  # one (vocab, dim) tensor, named tok_embeddings.weight (the first name)
            self.output.weight = self.tok_embeddings.weight
        # Context parallelism (dtk.parallel.cp): the input is this rank's slice of each
        # sequence, embedded at the full sequence's positions the layout names.
        self.cp: Any = None

    def reset_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter `name` in place.

        dtk calls this once per parameter with a generator seeded from (train.seed, name),
        so a value depends on its name alone: every scheme, shard and pipeline stage starts
        from the weights a single process would have (GPT-2 style: residual projections
        scaled by depth)."""
        std = 0.02
        if name.endswith("norm.weight"):
            nn.init.ones_(full)
        elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            nn.init.normal_(full, 0.0, std / math.sqrt(2 * self.num_layers), generator=generator)
        else:
            nn.init.normal_(full, 0.0, std, generator=generator)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            assert self.pos_embeddings is not None, "the first stage holds both embeddings"
            h = self.tok_embeddings(tokens)
            # (1, seq): the sequence is dim 1 as in h, so tensor parallelism can shard both alike.
            if self.cp is not None:
                positions = self.cp.positions(tokens.shape[1], tokens.device)
            else:
                positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
            h = h + self.pos_embeddings(positions)
        else:
            h = tokens  # a later pipeline stage receives activations
        for block in self.layers.values():  # blocks of other pipeline stages are nn.Identity
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


# The schema's defaults, so a caller outside dtk's config (a test, an export script) can
# give only the keys it cares about; the values live in dtk/config/schema.py alone.
_PARAMETERS = inspect.signature(Transformer).parameters
DEFAULTS = {f.name: f.default for f in dataclasses.fields(TransformerConfig) if f.name in _PARAMETERS}


def build(**kwargs) -> Transformer:
    """Factory named by `model._target_` in conf/model/transformer.yaml; keys left out take
    the schema's defaults."""
    return Transformer(**{**DEFAULTS, **kwargs})
