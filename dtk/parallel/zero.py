"""ZeRO-1: the optimizer state sharded over the data-parallel ranks, gradients as in DDP.

Every rank gets the whole (all-reduced) gradient, but steps only the parameters it owns,
with an ordinary optimizer over them; then each owner broadcasts its updated parameters.
Optimizer state memory drops by the data-parallel size; traffic grows by one parameter
broadcast per step.

The broadcasts are coalesced: each owner's parameters are packed, in order, into flat
buckets of up to BUCKET_BYTES of one dtype, and a bucket is one broadcast. A model of
hundreds of small tensors costs a few large collectives per step instead of hundreds of
small ones (each has a fixed launch and latency cost, on NCCL tens of microseconds).

The rank's local optimizer is a plain torch optimizer over its own parameters, so a
checkpoint of it holds exactly their state under their original names: it loads into any
other partition (another world size) or scheme.

With tensor parallelism (parameters are DTensors: DDP's wrapper replicates plain modules
only) the optimizer all-reduces the gradients itself, before the step's clipping
(`reduce_gradients`, called by the trainer): each tensor-parallel rank runs one ZeRO-1 over
its own data-parallel group, on its local shards, owners chosen by the shards' sizes (as
the planner counts them, dtk.plan.layout.rank_layout). Under a pipeline each stage has its
own ZeroOptimizer, as without tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dtk.common.errors import UserError
from dtk.plan.layout import zero1_owner

BUCKET_BYTES = 32 << 20  # per broadcast: large enough to run at bandwidth, small enough to overlap


def buckets(params: list[torch.nn.Parameter], limit: int = BUCKET_BYTES) -> list[list[torch.nn.Parameter]]:
    """`params` in order, cut into runs of one dtype and device of at most `limit` bytes (a
    larger tensor is a bucket of its own). Deterministic: every rank cuts alike."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = out[-1] if out else None
        if last is None or last[0].dtype != p.dtype or last[0].device != p.device or size + nbytes > limit:
            out.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor: a DTensor's local shard, else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def partition(params: list[torch.nn.Parameter], num_ranks: int) -> list[int]:
    """Owner of each parameter: the planner's rule (dtk.plan.layout.zero1_owner: largest
    first, to the least loaded rank, ties to the lowest) on the sizes this rank holds (a
    DTensor's local shard). Deterministic, so every rank computes the same answer."""
    return list(zero1_owner(tuple(local(p).numel() for p in params), num_ranks))


def _local_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """The gradient of `param` laid out as the parameter, as a local tensor (zeros where it
    has none, so every rank reduces the same buckets). A tensor-parallel gradient that came
    back in another layout (an embedding's, partial or whole) is redistributed first: a
    collective of the tensor-parallel ranks, which all reduce the same parameters in order."""
    from torch.distributed.tensor import DTensor

    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)


class ZeroOptimizer:
    """Steps this rank's share of the parameters and broadcasts every share."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        *,
        group: dist.ProcessGroup,
        reduces_gradients: bool = False,
    ) -> None:
        self.params = list(params)
        self.group = group
        self.reduces_gradients = reduces_gradients
        """No DDP wrapper reduces the gradients (tensor parallel): the trainer calls
        `reduce_gradients` before clipping (dtk.plan.layout.zero1_reduces_gradients)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if len(self.params) < size:
            raise UserError(
                f"scheme.shard_optimizer over {size} data-parallel ranks needs at least {size} parameters;"
                f" the model part has {len(self.params)}"
            )
        owner = partition(self.params, size)
        self.shares = [[p for p, o in zip(self.params, owner, strict=True) if o == r] for r in range(size)]
        self.local = make_optimizer(self.shares[rank])
        self.rank = rank
        # (owner, parameters) of each broadcast, the same list on every rank
        self.buckets = [(src, bucket) for src, share in enumerate(self.shares) for bucket in buckets(share)]
        self.grad_buckets = buckets([p for p in self.params if p.requires_grad])

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """All-reduce every gradient over the group to its mean (what DDP does, for a model
        DDP cannot wrap: tensor-parallel DTensors), bucketed like the broadcasts."""
        size = dist.get_world_size(self.group)
        grads = [[_local_grad(p) for p in bucket] for bucket in self.grad_buckets]
        flats = [g[0] if len(g) == 1 else torch._utils._flatten_dense_tensors(g) for g in grads]
        works = [dist.all_reduce(flat, group=self.group, async_op=True) for flat in flats]
        for g, flat, work in zip(grads, flats, works, strict=True):
            work.wait()
            flat.div_(size)
            if len(g) > 1:
                for grad, value in zip(g, torch._utils._unflatten_dense_tensors(flat, g), strict=True):
                    grad.copy_(value)

    @property
    def param_groups(self) -> list[dict]:
        return self.local.param_groups

    @torch.no_grad()
    def step(self) -> None:
        self.local.step()
        # One broadcast per bucket, all in flight at once; a one-tensor bucket goes in place.
        flats, works = [], []
        for src, bucket in self.buckets:
            if len(bucket) == 1:
                flat = local(bucket[0].detach())
            elif src == self.rank:
                flat = torch._utils._flatten_dense_tensors([local(p.detach()) for p in bucket])
            else:
                flat = torch.empty(sum(local(p).numel() for p in bucket), dtype=bucket[0].dtype,
                                   device=bucket[0].device)
            flats.append(flat)
            works.append(dist.broadcast(flat, group=self.group, group_src=src, async_op=True))
        for (src, bucket), flat, work in zip(self.buckets, flats, works, strict=True):
            work.wait()
            if len(bucket) > 1 and src != self.rank:
                pieces = [local(p) for p in bucket]
                for piece, value in zip(pieces, torch._utils._unflatten_dense_tensors(flat, pieces), strict=True):
                    piece.copy_(value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Every rank holds every gradient (ZeRO-1), not only those of its share.
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
