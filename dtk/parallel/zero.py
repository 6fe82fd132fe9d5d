"""ZeRO-1: the optimizer state sharded over the data-parallel ranks, gradients as in DDP.

Every rank gets the whole (all-reduced) gradient, but steps only the parameters it owns,
with an ordinary optimizer over them; then each owner broadcasts its updated parameters.
Optimizer state memory drops by the data-parallel size; traffic grows by one parameter
broadcast per step.

The rank's local optimizer is a plain torch optimizer over its own parameters, so a
checkpoint of it holds exactly their state under their original names: it loads into any
other partition (another world size) or scheme.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def partition(params: list[torch.nn.Parameter], num_ranks: int) -> list[int]:
    """Owner of each parameter: largest first, to the least loaded rank (ties: lowest rank).
    Deterministic, so every rank computes the same answer."""
    load = [0] * num_ranks
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        rank = min(range(num_ranks), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += params[i].numel()
    return owner


class ZeroOptimizer:
    """Steps this rank's share of the parameters and broadcasts every share."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        *,
        group: dist.ProcessGroup,
    ) -> None:
        self.params = list(params)
        self.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if len(self.params) < size:
            raise ValueError(
                f"scheme.shard_optimizer over {size} data-parallel ranks needs at least {size} parameters;"
                f" the model part has {len(self.params)}"
            )
        owner = partition(self.params, size)
        self.shares = [[p for p, o in zip(self.params, owner, strict=True) if o == r] for r in range(size)]
        self.local = make_optimizer(self.shares[rank])

    @property
    def param_groups(self) -> list[dict]:
        return self.local.param_groups

    @torch.no_grad()
    def step(self) -> None:
        self.local.step()
        # In place, all in flight at once: no flattening copies of the whole model.
        works = [
            dist.broadcast(p.detach(), group=self.group, group_src=src, async_op=True)
            for src, share in enumerate(self.shares)
            for p in share
        ]
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Every rank holds every gradient (ZeRO-1), not only those of its share.
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
