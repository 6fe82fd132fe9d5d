"""Top-k routed experts (model=moe): the feed-forward of the built-in transformer's blocks
when model.num_experts > 0.

Each token's router logits go through a softmax over the experts; the token goes to its
top_k experts (ties: the lower expert index first, a stable sort) and its output is their
SwiGLU outputs weighted by the k probabilities renormalized to sum to 1. The experts' weights
are stacked tensors, (num_experts, hidden, dim) and (num_experts, dim, hidden), so expert
parallelism (dtk.parallel.ep) shards them along their first dimension.

Dropless by default (`capacity_factor` 0): every routed token is computed. With a capacity
factor each expert takes at most ceil(capacity_factor x tokens x top_k / num_experts) of a
micro-batch's routed tokens on its rank, first choices before second ones and in token
order within a choice; a dropped assignment adds nothing (the residual carries the token).

The load-balancing loss (Switch Transformer / GShard) of a block is
`num_experts x sum_e f_e x P_e`: f_e the share of the routed assignments expert e got, P_e
its mean router probability. f_e is counted over the tokens of every rank that sees other
tokens of the step (`balance_group`, set by dtk.parallel.ep: one all-reduce of num_experts
numbers per block), so the loss a layout computes is the one of a single process; P_e is
this rank's mean, whose average over the ranks is the whole batch's. Each forward leaves
`aux_loss_weight` x its loss in `aux_loss`; the task adds the blocks' sum to the training
loss (`aux_loss(model)`).

Expert parallelism takes part through the attribute `ep` (None: every expert is here):
an object whose `run(tokens, counts, experts)` returns the experts' outputs of tokens
sorted by expert, `counts` tokens per expert.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """num_experts SwiGLU feed-forwards as three stacked weights; under expert parallelism
    each is a DTensor sharded over the ep ranks (this rank computes its local experts)."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        # The weights' gradients times this (expert parallelism: 1 / ep, dtk.parallel.ep).
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: tokens sorted by (local) expert, counts[e] of them for expert e."""
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        if self.grad_scale != 1.0:
            w1, w3, w2 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w3, w2))
        assert len(counts) == w1.shape[0], "one count per local expert"
        out = [F.linear(F.silu(F.linear(part, w1[e])) * F.linear(part, w3[e]), w2[e])
               for e, part in enumerate(x.split(counts))]
        return torch.cat(out) if out else x


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _local(w: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, *, num_experts: int, top_k: int, aux_loss_weight: float,
                 capacity_factor: float) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_weight, self.capacity_factor = aux_loss_weight, capacity_factor
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden)
        self.ep: Any = None  # dtk.parallel.ep's layout: the experts of other ranks
        self.balance_group: dist.ProcessGroup | None = None  # ranks whose routing counts are summed
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(tokens).float(), dim=-1)
        # A stable sort: equal probabilities go to the lower expert index, on every rank alike.
        top, chosen = torch.sort(probs, dim=-1, descending=True, stable=True)
        weights, chosen = top[:, :self.top_k], chosen[:, :self.top_k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        self.aux_loss = self._balance_loss(probs, chosen) if self.aux_loss_weight > 0 else None
        # Assignments in choice-major order (all first choices, then the second ones, ...).
        expert_ids, token_ids, gate = chosen.t().reshape(-1), _token_ids(tokens, self.top_k), weights.t().reshape(-1)
        if self.capacity_factor > 0:
            keep = self._within_capacity(expert_ids, len(tokens))
            expert_ids, token_ids, gate = expert_ids[keep], token_ids[keep], gate[keep]
        order = torch.argsort(expert_ids, stable=True)
        sorted_tokens = tokens[token_ids[order]]
        counts = torch.bincount(expert_ids, minlength=self.num_experts)
        if self.ep is not None:
            out = self.ep.run(sorted_tokens, counts, self.experts)
        else:
            out = self.experts(sorted_tokens, counts.tolist())
        combined = torch.zeros_like(tokens).index_add_(0, token_ids[order], out * gate[order, None].to(out.dtype))
        return combined.view(shape)

    def _within_capacity(self, expert_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        capacity = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        one_hot = F.one_hot(expert_ids, self.num_experts)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # the assignment's place in its expert's queue
        return position < capacity

    def _balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts).to(probs.dtype)
        if self.balance_group is not None:
            dist.all_reduce(counts, group=self.balance_group)
        share = counts / counts.sum()
        return self.aux_loss_weight * self.num_experts * (share * probs.mean(0)).sum()


def _token_ids(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The token of each choice-major assignment: 0..n-1, k times."""
    return torch.arange(len(tokens), device=tokens.device).repeat(k)


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the MoE blocks' load-balancing losses of the model's last forward (None:
    no MoE block, or the loss is off)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
