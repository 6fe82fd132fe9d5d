"""A tied model trained a few steps on gloo ranks exactly as a worker builds it (meta build,
parallelize, materialize, optimizer, clip), for tests/test_tied_embeddings.py.

`train_tied(rank, world, overrides, steps, tied)` composes the config from `overrides`, builds the
mesh of `world` ranks, trains `steps` AdamW steps on a fixed global batch (each data-parallel
rank its slice) and returns what a test holds against one process: the losses, the full
parameters, whether the two `tied` names are one parameter object, how many parameters the
optimizer holds and the checkpoint's model state keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

GLOBAL_BATCH = 8
TIED = ("tok_embeddings.weight", "output.weight")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _inner(part: torch.nn.Module) -> torch.nn.Module:
    return getattr(part, "module", part)  # DDP wraps the model


def train_tied(rank: int, world: int, overrides: list[str], steps: int, tied: tuple[str, str] = TIED) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from dtk.config.compose import compose
    from dtk.mesh.mesh import build_mesh
    from dtk.models.build import ParallelSpec, build_model, materialize
    from dtk.parallel.grad_norm import clip_grad_norm_
    from dtk.parallel.parallelize import parallelize
    from dtk.plan.degrees import resolve_degrees
    from dtk.plan.layout import uses_zero1
    from dtk.train.loss import TokenCrossEntropy, local_value, sharded_context
    from dtk.train.optim import build_optimizer

    cfg = compose(["optim.warmup_steps=0", *overrides])
    assert cfg.scheme is not None
    degrees = resolve_degrees(cfg.scheme, world)
    mesh = build_mesh(degrees, "cpu")
    meta = build_model(cfg.model, device="meta", seed=0)
    loss_fn = TokenCrossEntropy()
    model = parallelize(
        meta, mesh=mesh, scheme=cfg.scheme, spec=ParallelSpec.from_config(cfg.model).with_model_defaults(meta),
        device=torch.device("cpu"), loss_fn=loss_fn, num_microbatches=1, sharded_logits=True,
        materialize=lambda parts, on: materialize(parts, model_cfg=cfg.model, device=on, seed=0),
    )
    (part,) = model.parts
    inner = _inner(part)
    shard_group = mesh.dp_group if uses_zero1(cfg.scheme, mesh.degrees) else None
    optimizer = build_optimizer(part.parameters(), optim=cfg.optim, shard_group=shard_group)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.model.vocab_size, (GLOBAL_BATCH, cfg.model.seq_len + 1), generator=g)
    local = GLOBAL_BATCH // mesh.dp_size
    mine = tokens[mesh.dp_rank * local:(mesh.dp_rank + 1) * local]
    inputs, targets = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
    losses, norms = [], []
    for _ in range(steps):
        logits = part(inputs)
        loss = loss_fn(logits, targets)
        with sharded_context(loss):
            loss.backward()
        norms.append(clip_grad_norm_(list(part.parameters()), cfg.optim.grad_clip).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = local_value(loss).detach()
        if mesh.dp_size > 1:
            torch.distributed.all_reduce(value, group=mesh.dp_group)
        losses.append(value.item() / mesh.dp_size)
    names_of_state = sorted(get_model_state_dict(part))
    return {
        "losses": losses,
        "norms": norms,
        "params": {name: _full(p) for name, p in inner.named_parameters()},
        "one_object": inner.get_parameter(tied[0]) is inner.get_parameter(tied[1]),
        "num_parameters": len(list(part.parameters())),
        "state_keys": names_of_state,
        "placements": str(getattr(inner.get_parameter(tied[0]), "placements", "plain")),
    }


def train_tied_pp(rank: int, world: int, overrides: list[str], steps: int) -> dict[str, Any]:
    """As `train_tied`, under a pipeline of `world` stages (one rank each, 1F1B, 2
    micro-batches) as dtk.train.trainer runs it: what each stage holds, the losses (last
    stage), the gradient norms and each stage's parameters after the steps."""
    from dtk.config.compose import compose
    from dtk.mesh.mesh import build_mesh
    from dtk.models.build import ParallelSpec, build_model, materialize
    from dtk.parallel.grad_norm import clip_grad_norm_
    from dtk.parallel.parallelize import parallelize
    from dtk.plan.degrees import resolve_degrees
    from dtk.train.loss import TokenCrossEntropy
    from dtk.train.optim import build_optimizer

    cfg = compose(["optim.warmup_steps=0", "+scheme=pp", f"scheme.pp={world}", *overrides])
    assert cfg.scheme is not None
    mesh = build_mesh(resolve_degrees(cfg.scheme, world), "cpu")
    meta = build_model(cfg.model, device="meta", seed=0)
    model = parallelize(
        meta, mesh=mesh, scheme=cfg.scheme, spec=ParallelSpec.from_config(cfg.model), device=torch.device("cpu"),
        loss_fn=TokenCrossEntropy(), num_microbatches=2, sharded_logits=False,
        materialize=lambda parts, on: materialize(parts, model_cfg=cfg.model, device=on, seed=0),
    )
    pipe = model.pipeline
    assert pipe is not None
    (part,) = model.parts
    optimizer = build_optimizer(part.parameters(), optim=cfg.optim)
    initial = {name: p.detach().clone() for name, p in part.named_parameters()}
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.model.vocab_size, (GLOBAL_BATCH, cfg.model.seq_len + 1), generator=g)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses, norms = [], []
    for _ in range(steps):
        step_losses: list[torch.Tensor] = []
        args = (inputs,) if pipe.has_first_stage else ()
        kwargs = {"target": targets, "losses": step_losses} if pipe.has_last_stage else {}
        pipe.schedule.step(*args, **kwargs)
        norms.append(clip_grad_norm_(list(part.parameters()), cfg.optim.grad_clip, pp_group=mesh.pp_group).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step_losses:
            losses.append(torch.stack([loss.detach() for loss in step_losses]).mean().item())
    return {
        "losses": losses,
        "norms": norms,
        "initial": initial,
        "params": {name: _full(p) for name, p in part.named_parameters()},
    }
