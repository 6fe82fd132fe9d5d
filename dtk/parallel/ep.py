"""Expert parallelism (scheme.ep) and the mixture of experts' place on the mesh (model=moe).

The ep ranks are carved out of dp_shard x cp (dtk.mesh.mesh.expert_mesh): ep consecutive
ranks of the flattened dp_shard x cp, each holding num_experts / ep of every block's experts
(their stacked weights are DTensors sharded along the expert dimension over ep). Each rank
routes its own tokens (dtk.models.moe), then

    1. all-to-all of the counts: how many tokens each rank sends each expert
    2. all-to-all of the tokens, sorted by expert, so each goes to its expert's rank
    3. the rank's experts on what it received (regrouped by expert)
    4. all-to-all back, in the order the tokens came, then weighted and summed per token

The all-to-all's backward is the all-to-all the other way (`_AllToAll`), so the gradient of
an expert's weights holds the tokens of every ep rank's batch, and each token's gradient
returns to its rank.

The experts' parameters are sharded by FSDP over the rest of dp_shard x cp
(dp_shard_mod_ep; with HSDP replicated over dp_replicate too), one FSDP unit per block's
experts, inside the block's unit over dp_shard x cp. Their gradient is a sum over the ep
group's tokens (ep ranks' batches), which FSDP then averages over the replicas of the same
experts (dp_shard_mod_ep ranks): the experts scale their weights' gradients by 1 / ep
(`Experts.grad_scale`), so the result is the gradient of the mean over the step's batch like
the others'. (FSDP's own `set_gradient_divide_factor` would do it in the reduction, but
needs a PREMUL_SUM reduction, which gloo does not have.)

Whatever ep is, `apply_ep` gives every MoE block the group of the ranks that see other
tokens of the step (the load-balancing loss counts its routing shares over them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from dtk.mesh.mesh import EP_SHARD, ParallelMesh
from dtk.models.moe import Experts, MoE
from dtk.plan.degrees import Axis, CarvedAxis


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


@dataclass(frozen=True)
class EpLayout:
    """One rank's place on the ep axis: its experts are local experts [rank x n, (rank + 1) x n)."""

    rank: int
    size: int
    group: dist.ProcessGroup

    def run(self, tokens: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """The experts' outputs of `tokens` (this rank's, sorted by expert; counts[e] for
        expert e of all num_experts), computed on the experts' ranks, in `tokens`' order."""
        local = counts.numel() // self.size
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source rank, local expert]
        sent = counts.view(self.size, local).sum(1).tolist()
        got = received.view(self.size, local)
        arrived = _AllToAll.apply(tokens, got.sum(1).tolist(), sent, self.group)
        # (source, expert) pieces -> (expert, source) order, the experts' inputs one after another
        pieces = arrived.split(got.flatten().tolist())
        by_expert = [pieces[s * local + e] for e in range(local) for s in range(self.size)]
        out = experts(torch.cat(by_expert), got.sum(0).tolist())
        done = out.split([int(got[s, e]) for e in range(local) for s in range(self.size)])
        back = torch.cat([done[e * self.size + s] for s in range(self.size) for e in range(local)])
        return _AllToAll.apply(back, sent, got.sum(1).tolist(), self.group)


def balance_group(mesh: ParallelMesh, *, local_replicas: bool) -> dist.ProcessGroup | None:
    """The ranks that see other tokens of a step (the plan refuses tp and pp with experts):
    every rank, or one replica's dp_shard x cp when replicas step on their own (+sync)."""
    if mesh.world is None or mesh.world_size == 1:
        return None
    return mesh.fsdp_shard.get_group() if local_replicas else dist.group.WORLD


def apply_ep(module: nn.Module, *, mesh: ParallelMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
             reshard_after_forward: bool, local_replicas: bool) -> None:
    """Give each MoE block its balance group and, with ep > 1, its EpLayout, its experts
    sharded over ep and FSDP units of their own (module doc). Nothing for a model without
    MoE blocks."""
    blocks = [m for m in module.modules() if isinstance(m, MoE)]
    for block in blocks:
        block.balance_group = balance_group(mesh, local_replicas=local_replicas)
    degrees = mesh.degrees
    if degrees.ep == 1 or not blocks:
        return
    assert mesh.experts is not None, "build_mesh makes the expert mesh when ep > 1"
    ep_mesh = mesh.experts[CarvedAxis.ep.value]
    replicate = degrees.dp_replicate > 1 and not local_replicas
    fsdp_mesh = mesh.experts[(Axis.dp_replicate.value, EP_SHARD)] if replicate else mesh.experts[EP_SHARD]
    layout = EpLayout(rank=ep_mesh.get_local_rank(), size=degrees.ep, group=ep_mesh.get_group())
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        block.ep = layout
        experts = block.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))
        experts.grad_scale = 1.0 / degrees.ep  # with FSDP's mean over the replicas: the whole batch's mean
        fully_shard(experts, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
