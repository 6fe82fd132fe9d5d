"""Global gradient-norm clipping over any mix of sharded and replicated gradients.

Gradients may be plain tensors (DDP, replicated params under tensor parallelism) or
DTensors on different meshes (FSDP shards, tensor-parallel shards, both). Each group of
the same kind gets one norm (a DTensor norm reduces over the mesh axes it is sharded
on), and pipeline stages, which hold disjoint parameters, add their squares.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtk.parallel.stage_ties import COPY_MARK


def _group_key(t: torch.Tensor):
    if isinstance(t, DTensor):
        return ("dtensor", t.device_mesh, tuple(t.placements))
    return ("plain", t.device, t.dtype)


@torch.no_grad()
def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float, *, pp_group=None) -> torch.Tensor:
    """Clip in place to `max_norm` (0: measure only); return the global norm before clipping,
    a 0-dim tensor on the gradients' device (no host sync)."""
    groups: dict = defaultdict(list)
    copies: list[torch.Tensor] = []  # a pipeline stage's copy of a weight tied to another stage's: scaled, counted once
    for p in params:
        if p.grad is not None:
            (copies if getattr(p, COPY_MARK, False) else groups[_group_key(p.grad)]).append(p.grad)
    device = next((g[0].device for g in groups.values()), torch.device("cpu"))
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += norm.float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        # As torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), at most 1.
        # The coefficient stays a tensor on the device: reading it as a Python float would
        # make the host wait for the whole backward every step.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in [*groups.values(), copies]:
            # A DTensor's local shard is a view of its storage: scaling it scales the DTensor.
            local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
            if local:
                torch._foreach_mul_(local, coef.to(local[0].device))
    return total
