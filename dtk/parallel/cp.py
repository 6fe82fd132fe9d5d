"""Context parallelism (scheme.cp): each rank of the cp axis holds a slice of every sequence.

The slice is load-balanced for the causal mask: the sequence is cut into 2 x cp equal
chunks and cp rank i holds chunks i and 2 x cp - 1 - i (a head and a tail), so every rank
attends over about the same number of (query, key) pairs:

    cp=2, 4 chunks:   rank 0: [c0 | c3]     rank 1: [c1 | c2]

Attention stays exact. Each block all-gathers the keys and values of the whole sequence
over the cp group (as Llama 3's context parallelism does; no ring of point-to-point steps)
and puts them in sequence order; the queries of chunk j then attend over the first j + 1
chunks of keys, causal at the lower right (a boolean mask of chunk x keys; the head chunk
of rank 0 by SDPA's own causal flag), so a query at position p sees exactly the keys at
positions <= p, and a rank scores only the keys up to the end of each of its chunks. The backward of the gather is a reduce-scatter: each rank
gets the sum of every rank's gradient for its own keys and values. The positions the model
embeds (learned positions, RoPE) are those of the full sequence (`CpLayout.positions`).

The loss of a rank is the mean over its own tokens; every cp rank holds the same number
of them, so the mean of the ranks' means is the mean over the whole sequence. The value a
step reports is that mean (an all-reduce over cp); the gradient of each rank is the one of
its own mean, and FSDP's average over dp_shard x cp (dtk.mesh.mesh) makes it the gradient
of the whole sequence's mean.

A model takes part by having an attribute `cp` (None) on its root and on each attention
module: `apply_cp` sets them to the rank's `CpLayout`, whose `positions` the root embeds
and whose `attention` the attention modules call instead of causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from dtk.common.errors import UserError
from dtk.mesh.mesh import ParallelMesh
from dtk.plan.degrees import Axis


def chunk_positions(seq_len: int, cp: int, rank: int) -> list[range]:
    """The two ranges of positions of a sequence of `seq_len` that cp rank `rank` holds, in
    the order it holds them: chunk `rank` and chunk `2 x cp - 1 - rank` of 2 x cp."""
    size = seq_len // (2 * cp)
    assert size * 2 * cp == seq_len, f"seq_len {seq_len} is not a multiple of 2 x cp = {2 * cp}"
    head, tail = rank, 2 * cp - 1 - rank
    return [range(head * size, (head + 1) * size), range(tail * size, (tail + 1) * size)]


def shard_sequence(t: torch.Tensor, *, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """cp rank `rank`'s slice of a full-sequence tensor (its two chunks along `dim`)."""
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather over the cp group into a new leading dimension (rank order); backward:
    reduce-scatter, so each rank receives the sum of all ranks' gradients of its piece."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        local = local.contiguous()
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))  # gloo: pieces along dim 0
        dist.all_gather_single(out, local, group=group)
        return out.view(size, *local.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        mine = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(mine, grad.flatten(0, 1), group=ctx.group)
        return mine, None, None


def _lower_right(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """(queries, keys) boolean mask, True where a query attends: the causal mask aligned at
    the lower right (the last query sees every key). torch's `causal_lower_right` would let a
    GPU's kernels skip the mask, but making it fails inside dtk's workers (a tensor subclass
    whose creation collides with an existing tensor's Python object), so it is not used."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


def _sequence_order(gathered: torch.Tensor) -> torch.Tensor:
    """(cp, batch, heads, 2 x chunk, head_dim) of every rank's two chunks, in rank order ->
    (batch, heads, seq_len, head_dim) in sequence order: chunks 0..cp-1 are the ranks'
    heads, chunks cp..2cp-1 their tails in reverse rank order."""
    cp, bsz, heads, local, head_dim = gathered.shape
    halves = gathered.view(cp, bsz, heads, 2, local // 2, head_dim)
    chunks = torch.cat([halves[:, :, :, 0], halves[:, :, :, 1].flip(0)])  # (2cp, batch, heads, chunk, head_dim)
    return chunks.permute(1, 2, 0, 3, 4).reshape(bsz, heads, cp * local, head_dim)


@dataclass(frozen=True)
class CpLayout:
    """One rank's place on the cp axis: what the model and the task ask of it."""

    rank: int
    size: int
    group: dist.ProcessGroup

    @staticmethod
    def of(mesh: ParallelMesh) -> CpLayout | None:
        """This rank's layout; None without context parallelism (cp=1)."""
        group = mesh.cp_group
        if group is None:
            return None
        return CpLayout(rank=mesh.rank(Axis.cp), size=mesh.size(Axis.cp), group=group)

    def positions_of(self, rank: int, local_len: int, device: torch.device) -> torch.Tensor:
        ranges = chunk_positions(local_len * self.size, self.size, rank)
        return torch.cat([torch.arange(r.start, r.stop, device=device) for r in ranges])

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """(1, local_len): the full sequence's positions of this rank's tokens."""
        return self.positions_of(self.rank, local_len, device).unsqueeze(0)

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a full-sequence tensor (token ids, targets)."""
        if t.shape[dim] % (2 * self.size):
            raise UserError(
                f"a sequence of {t.shape[dim]} tokens with scheme.cp={self.size}: it must split into 2 x cp ="
                f" {2 * self.size} equal chunks; make model.seq_len a multiple of {2 * self.size}"
            )
        return shard_sequence(t, cp=self.size, rank=self.rank, dim=dim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        """Causal attention of this rank's queries (batch, heads, local, head_dim) over the
        keys and values of the whole sequence, gathered from the cp group (`enable_gqa`:
        fewer key / value heads than query heads, as SDPA takes them). With the keys in
        sequence order, the queries of chunk j see exactly the first (j + 1) chunks of keys,
        causally aligned at the lower right (module doc)."""
        chunk = k.shape[2] // 2
        full_k = _sequence_order(_GatherSequence.apply(k, self.group, self.size))
        full_v = _sequence_order(_GatherSequence.apply(v, self.group, self.size))
        out = []
        for half, index in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            query = q[:, :, half * chunk:(half + 1) * chunk]
            seen = (index + 1) * chunk  # the keys up to the end of this chunk
            causal = {"is_causal": True} if seen == chunk else {"attn_mask": _lower_right(chunk, seen, q.device)}
            out.append(F.scaled_dot_product_attention(query, full_k[:, :, :seen], full_v[:, :, :seen], scale=scale,
                                                      enable_gqa=enable_gqa, **causal))
        return torch.cat(out, dim=2)

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole sequence's mean loss as the value, this rank's own mean for the gradient
        (module doc): every cp rank holds as many tokens as the others."""
        local = loss.to_local() if isinstance(loss, DTensor) else loss
        total = local.detach().clone()
        dist.all_reduce(total, group=self.group)
        shift = total / self.size - local.detach()
        if isinstance(loss, DTensor):
            shift = DTensor.from_local(shift, loss.device_mesh, loss.placements)
        return loss + shift

    def total(self, summed: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
        """A sum over this rank's tokens and its count, made the whole sequence's (evaluation)."""
        summed = summed.detach().clone()
        dist.all_reduce(summed, group=self.group)
        return summed, count * self.size


def apply_cp(module: nn.Module, *, layout: CpLayout) -> None:
    """Give `layout` to every submodule that takes part (an attribute `cp`, see the module
    doc). Raises UserError for a model with no such module: its attention would see only
    this rank's slice of each sequence."""
    holders = [m for m in module.modules() if hasattr(m, "cp")]
    if not holders:
        raise UserError(
            f"scheme.cp={layout.size}: the model {type(module).__name__} has no module with a `cp` attribute"
            " (dtk.parallel.cp), so its attention cannot see the other ranks' part of each sequence; use scheme.cp=1"
        )
    for m in holders:
        setattr(m, "cp", layout)  # noqa: B010 (an attribute nn.Module does not declare)
