"""The checks tests/test_multirank.py runs on 2 gloo ranks, each against its one-process
equivalent computed in the same process. Every check returns plain numbers and tensors
(differences, values), so the test asserts in the parent where pytest shows them."""

from __future__ import annotations

import os
import signal
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dtk.checkpoint.sharded import Comm
from dtk.config.choices import PipelineSchedule, TpStyle
from dtk.models.transformer import build as build_transformer
from dtk.parallel.grad_norm import clip_grad_norm_
from dtk.parallel.pipeline import autocast_stage, build_pipeline, split_model
from dtk.parallel.tp import apply_tp
from dtk.parallel.zero import ZeroOptimizer
from dtk.train.loss import TokenCrossEntropy, local_value, sharded_context
from dtk.train.trainer import tick_after_actions
from dtk.worker.signals import StopFlag, vote_group

VOCAB, DIM, HIDDEN, SEQ, BATCH = 16, 8, 16, 4, 3


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Tiny(nn.Module):
    """One module per tensor-parallel style: embedding rowwise, norm sequence_parallel, the
    MLP's input gathered (sequence_gather), up colwise, down rowwise, head colwise_output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.mlp = Mlp()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.mlp(self.norm(h))
        return self.head(h)


TP_PLAN = {
    "embed": TpStyle.rowwise,
    "norm": TpStyle.sequence_parallel,
    "mlp": TpStyle.sequence_gather,
    "mlp.up": TpStyle.colwise,
    "mlp.down": TpStyle.rowwise,
    "head": TpStyle.colwise_output,
}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_tp(rank: int, world: int) -> dict[str, Any]:
    """Output and every parameter gradient of the tensor-parallel model against the plain one."""
    torch.manual_seed(0)
    reference = Tiny()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    out_ref = reference(tokens)
    out_ref.square().mean().backward()
    grads_ref = {n: p.grad for n, p in reference.named_parameters()}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    result = {}
    for sequence_parallel in (False, True):
        model = Tiny()
        model.load_state_dict(reference.state_dict())
        apply_tp(model, mesh=mesh, tp_plan=TP_PLAN, sequence_parallel=sequence_parallel, loss_parallel=False)
        out = model(tokens)
        out.square().mean().backward()
        sharded = sum(isinstance(p, DTensor) and p.placements[0].is_shard() for p in model.parameters())
        result[sequence_parallel] = {
            "output": (out - out_ref).abs().max().item(),
            "grads": {n: (_full(p.grad) - grads_ref[n]).abs().max().item() for n, p in model.named_parameters()},
            "sharded_parameters": sharded,
        }
    return result


def check_loss_parallel(rank: int, world: int) -> dict[str, Any]:
    """The head's logits stay sharded over the vocabulary; the loss (TokenCrossEntropy, its
    backward under loss_parallel as the trainer runs it) and every gradient match the plain
    model's, and so does the summed evaluation loss."""
    torch.manual_seed(0)
    reference = Tiny()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ))
    loss_fn = TokenCrossEntropy()
    loss_ref = loss_fn(reference(tokens), targets)
    loss_ref.backward()
    summed_ref, _ = loss_fn.total(reference(tokens).detach(), targets)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    result = {}
    for sequence_parallel in (False, True):
        model = Tiny()
        model.load_state_dict(reference.state_dict())
        apply_tp(model, mesh=mesh, tp_plan=TP_PLAN, sequence_parallel=sequence_parallel, loss_parallel=True)
        logits = model(tokens)
        loss = loss_fn(logits, targets)
        with sharded_context(logits):
            loss.backward()
        with torch.no_grad():
            summed, count = loss_fn.total(model(tokens), targets)
        result[sequence_parallel] = {
            "local_logits": tuple(logits.to_local().shape) if isinstance(logits, DTensor) else None,
            "full_logits": (BATCH, SEQ, VOCAB),
            "loss": abs(local_value(loss.detach()).item() - loss_ref.item()),
            "summed": abs(summed.item() - summed_ref.item()),
            "grads": {n: (_full(p.grad) - reference.get_parameter(n).grad).abs().max().item()
                      for n, p in model.named_parameters()},
        }
    return result


def check_pp_autocast(rank: int, world: int) -> dict[str, Any]:
    """A 2-stage pipeline in bfloat16 autocast (CPU): stage 0 sends bfloat16, the backward
    runs outside autocast, and the loss is the one-process autocast loss up to the rounding
    of the activations at the stage boundary."""
    torch.manual_seed(0)
    full = build_transformer(vocab_size=VOCAB, dim=DIM, num_layers=2, num_heads=2, seq_len=SEQ)
    tokens = torch.randint(0, VOCAB, (4, SEQ))
    targets = torch.randint(0, VOCAB, (4, SEQ))
    loss_fn = TokenCrossEntropy()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = full(tokens)
    reference = loss_fn(logits, targets).item()
    parts, ids, _ = split_model(full, split_points=(), pp_rank=rank, pp=world, virtual=1)
    for part, i in zip(parts, ids, strict=True):
        autocast_stage(part, device_type="cpu", dtype=torch.bfloat16, sends=i < world - 1)
    sent, in_backward = [], []
    parts[0].register_forward_hook(lambda m, a, out: sent.append(out.dtype))
    for p in parts[0].parameters():
        p.register_hook(lambda g: in_backward.append(torch.is_autocast_enabled("cpu")) or g)
    pipe = build_pipeline(parts, ids, num_stages=world, schedule=PipelineSchedule("gpipe"), num_microbatches=2,
                          loss_fn=loss_fn, device=torch.device("cpu"), group=dist.group.WORLD)
    ticks: list = []  # the trainer's heartbeat ticks, one per pipeline action
    for stage in pipe.stages:
        tick_after_actions(stage, lambda: ticks.append(1))
    losses: list = []
    if pipe.has_first_stage:
        pipe.schedule.step(tokens)
    else:
        pipe.schedule.step(target=targets, losses=losses)
    return {
        "sent": [str(d) for d in sent],
        "autocast_in_backward": sorted(set(in_backward)),
        "loss": torch.stack(losses).mean().item() if losses else None,
        "reference": reference,
        "ticks": len(ticks),
    }


def check_zero(rank: int, world: int) -> dict[str, Any]:
    """ZeRO-1 over the ranks against one AdamW holding every parameter: the same values."""
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2), (3,)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]  # the same on every rank (all-reduced)
    plain = [nn.Parameter(t.clone()) for t in start]
    sharded = [nn.Parameter(t.clone()) for t in start]
    adam = torch.optim.AdamW(plain, lr=0.1)
    zero = ZeroOptimizer(sharded, lambda share: torch.optim.AdamW(share, lr=0.1), group=dist.group.WORLD)
    broadcast, calls = dist.broadcast, []

    def counted(*args, **kwargs):
        calls.append(1)
        return broadcast(*args, **kwargs)

    dist.broadcast = counted
    try:
        for step_grads in grads:
            for p, q, g in zip(plain, sharded, step_grads, strict=True):
                p.grad, q.grad = g.clone(), g.clone()
            adam.step()
            zero.step()
            zero.zero_grad()
    finally:
        dist.broadcast = broadcast
    owned = sum(p.numel() for p in zero.shares[rank])
    return {
        "max_difference": max((p - q).abs().max().item() for p, q in zip(plain, sharded, strict=True)),
        "owned_elements": owned,
        "local_state": len(zero.local.state),
        "grads_cleared": all(q.grad is None for q in sharded),
        "broadcasts_per_step": len(calls) / len(grads),
    }


def check_clip(rank: int, world: int) -> dict[str, Any]:
    """The global norm and the clipped gradients against torch.nn.utils.clip_grad_norm_ on
    the whole, unsharded set: (a) a DTensor-sharded weight beside a replicated bias, (b)
    pipeline stages holding disjoint parameters, summed over the pipeline group."""
    torch.manual_seed(0)
    weight, bias = torch.randn(4, 6), torch.randn(6)
    g_weight, g_bias = torch.randn(4, 6) * 3, torch.randn(6) * 3
    stages = [torch.randn(5) * (i + 1) for i in range(world)]
    g_stages = [torch.randn(5) * (i + 2) for i in range(world)]

    full = [nn.Parameter(weight.clone()), nn.Parameter(bias.clone())]
    full[0].grad, full[1].grad = g_weight.clone(), g_bias.clone()
    norm_ref = torch.nn.utils.clip_grad_norm_(full, max_norm=1.0)

    mesh = init_device_mesh("cpu", (world,))
    w = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    w.grad = distribute_tensor(g_weight, mesh, [Shard(0)])
    b = nn.Parameter(bias.clone())
    b.grad = g_bias.clone()
    norm = clip_grad_norm_([w, b], 1.0)

    whole = [nn.Parameter(s.clone()) for s in stages]
    for p, g in zip(whole, g_stages, strict=True):
        p.grad = g.clone()
    pp_norm_ref = torch.nn.utils.clip_grad_norm_(whole, max_norm=1.0)
    mine = nn.Parameter(stages[rank].clone())
    mine.grad = g_stages[rank].clone()
    pp_norm = clip_grad_norm_([mine], 1.0, pp_group=dist.group.WORLD)
    return {
        "norm": (norm.item(), norm_ref.item()),
        "clipped": max((w.grad.full_tensor() - full[0].grad).abs().max().item(), (b.grad - full[1].grad).abs().max().item()),
        "pp_norm": (pp_norm.item(), pp_norm_ref.item()),
        "pp_clipped": (mine.grad - whole[rank].grad).abs().max().item(),
    }


def check_stop_flag(rank: int, world: int) -> dict[str, Any]:
    """A real SIGUSR2 on rank 1 only: every rank agrees on it; before it, none saw one."""
    flag = StopFlag().install()
    group = vote_group()
    before = flag.agreed(group)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR2)
    dist.barrier()
    after = flag.agreed(group)
    seconds = flag.vote(group, 0.5 + rank)[1]  # the largest step time any rank measured
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    single = StopFlag()  # one process: what it saw is what is agreed
    single.signum = int(signal.SIGTERM)
    return {"before": before, "after": after, "expected": int(signal.SIGUSR2), "own": flag.signum,
            "seconds": seconds, "alone": single.vote(None, 0.25)}


def check_comm(rank: int, world: int) -> dict[str, Any]:
    """The checkpoint's own group against the one-process Comm(None)."""
    comm, alone = Comm.create(), Comm(None)
    comm.barrier()
    return {
        "rank": (comm.rank, comm.world_size),
        "broadcast": comm.broadcast({"from": rank}),
        "all_gather": comm.all_gather(rank * 10),
        "any": (comm.any(rank == 1), comm.any(False)),
        "alone": (alone.broadcast({"from": rank}), alone.all_gather(rank * 10), alone.any(True), alone.any(False)),
    }


def check_group_timeouts(rank: int, world: int) -> dict[str, Any]:
    """A world made with dist.timeout_s = 77 s: every group the mesh builds (each axis, the
    flattened data-parallel one), the checkpoint's and the stop vote's run under 77 s, not
    torch's defaults for new groups (30 minutes for gloo)."""
    import datetime

    from torch.distributed import distributed_c10d as c10d

    from dtk.mesh.groups import timeout_of
    from dtk.mesh.mesh import build_mesh
    from dtk.plan.degrees import Degrees

    before = timeout_of()
    c10d._set_pg_timeout(datetime.timedelta(seconds=77))  # as init_process_group(timeout=77 s) leaves it
    plain = dist.new_group(backend="gloo")  # what torch gives a new group by itself
    mesh = build_mesh(Degrees(dp_replicate=1, pp=1, dp_shard=world, tp=1), "cpu")
    groups = [mesh.world.get_group(name) for name in mesh.world.mesh_dim_names] + [mesh.dp_group]
    found = [timeout_of(g).total_seconds() for g in groups]
    found += [timeout_of(Comm.create().group).total_seconds(), timeout_of(vote_group()).total_seconds()]
    c10d._set_pg_timeout(before)
    return {"timeouts": found, "plain": timeout_of(plain).total_seconds(), "num_groups": len(groups)}


CHECKS = {"tp": check_tp, "loss_parallel": check_loss_parallel, "pp_autocast": check_pp_autocast, "zero": check_zero, "clip": check_clip, "stop_flag": check_stop_flag, "comm": check_comm,
          "group_timeouts": check_group_timeouts}


def all_checks(rank: int, world: int) -> dict[str, Any]:
    """Every check, in one spawn; a check that raises reports its traceback instead."""
    out: dict[str, Any] = {}
    for name, check in CHECKS.items():
        try:
            out[name] = check(rank, world)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out
