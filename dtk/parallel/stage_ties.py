"""A weight tied across pipeline stages: the token embedding on the first stage, the output
head tied to it on the last (as Megatron-LM does it).

Each stage that holds one of the tie's names holds its own copy of the weight:

- the copies start equal: a stage that holds only a later name records it in the stage
  module's `ELSEWHERE` map (later name -> first name), and materialization initialises the
  copy under the first name (dtk.models.build);
- their gradients are summed over an embedding group (the pipeline ranks of those stages,
  one group per data/tensor-parallel coordinate) after every schedule step, before
  clipping, so the copies take the same step and stay equal;
- the gradient norm counts the tie once: the copies of later names are marked
  (`COPY_MARK`) and left out of it (dtk.parallel.grad_norm);
- the checkpoint holds the weight once, under its first name: the stage's later name is
  saved and loaded under the first (dtk.checkpoint.sharded, dtk.models.ties.stage_keys), so
  a checkpoint of a pipeline loads under any other scheme and back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dtk.common.errors import UserError
from dtk.models.ties import ELSEWHERE, tied_groups
from dtk.plan.degrees import Axis

COPY_MARK = "_dtk_tied_copy"
"""Set on a stage's copy of a weight whose first name another stage holds."""


@dataclass(frozen=True)
class StageTie:
    names: tuple[str, ...]
    """The tie's names, the first first."""
    pp_ranks: tuple[int, ...]
    """The pipeline ranks whose stages hold one of the names."""


def _stage_of(name: str, stages: list[list[str]]) -> int:
    found = [s for s, paths in enumerate(stages) if any(name.startswith(f"{p}.") for p in paths)]
    assert len(found) == 1, f"{name} is in one pipeline unit"
    return found[0]


def stage_ties(model: nn.Module, stages: list[list[str]], pp: int) -> list[StageTie]:
    """The ties of `model` that the cut into `stages` (unit paths of each) spreads over
    several stages. Two stages of one pipeline rank holding the same tie: UserError."""
    ties = []
    for names in tied_groups(model):
        held = sorted({_stage_of(n, stages) for n in names})
        if len(held) < 2:
            continue
        ranks = [s % pp for s in held]
        if len(set(ranks)) < len(ranks):
            raise UserError(
                f"the model ties {' and '.join(names)}, and the pipeline cut puts two stages holding them on one"
                f" pipeline rank (stages {held}); use other model.split_points or scheme.pp_virtual_stages=1"
            )
        ties.append(StageTie(names=names, pp_ranks=tuple(ranks)))
    return ties


def mark_stage(stage: nn.Module, ties: list[StageTie]) -> None:
    """Record in the stage module which of its names are later names of a tie whose first
    name is on another stage."""
    from dtk.models.ties import holds

    elsewhere = {}
    for tie in ties:
        held = [n for n in tie.names if holds(stage, n)]
        if held and held[0] != tie.names[0]:
            elsewhere[held[0]] = tie.names[0]
    setattr(stage, ELSEWHERE, elsewhere)


def embedding_groups(world, ties: list[StageTie]) -> list[dist.ProcessGroup | None]:
    """For each tie, this rank's group of the pipeline ranks holding it (same coordinate on
    every other axis), or None. Collective: every rank creates every group, in one order."""
    grid = world.mesh
    pp_dim = list(world.mesh_dim_names).index(Axis.pp.value)
    rows = grid.movedim(pp_dim, -1).reshape(-1, grid.shape[pp_dim]).tolist()
    me = dist.get_rank()
    mine: list[dist.ProcessGroup | None] = []
    for tie in ties:
        found = None
        for row in rows:
            ranks = [row[r] for r in tie.pp_ranks]
            group = dist.new_group(ranks)
            if me in ranks:
                found = group
        mine.append(found)
    return mine


def _laid_out_as_param(param: nn.Parameter) -> torch.Tensor:
    """The local gradient of `param`, laid out as the parameter: a tensor-parallel
    embedding's gradient may come back whole or partial, the head's is a shard; the two
    stages must sum the same shard (the redistribution is a collective of the stage's tp
    ranks)."""
    from torch.distributed.tensor import DTensor

    grad = param.grad
    assert grad is not None
    if isinstance(grad, DTensor):
        assert isinstance(param, DTensor), "a DTensor gradient belongs to a DTensor parameter"
        if tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
            param.grad = grad
        return grad.to_local()
    return grad


def grad_sync(parts: list[nn.Module], ties: list[StageTie], groups: list[dist.ProcessGroup | None]
              ) -> Callable[[], None]:
    """Sum the gradients of each tie's copies over its embedding group (after a schedule step)."""
    held: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
    for tie, group in zip(ties, groups, strict=True):
        if group is None:
            continue
        for part in parts:
            from dtk.models.ties import holds

            names = [n for n in tie.names if holds(part, n)]
            if names:
                held.append((part.get_parameter(names[0]), group))

    @torch.no_grad()
    def sync() -> None:
        for param, group in held:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(_laid_out_as_param(param), group=group)

    return sync


def mark_copies(parts: list[nn.Module]) -> None:
    """Mark each stage's copies of weights whose first name another stage holds (after
    materialization, which gives the parameters their final objects)."""
    for part in parts:
        inner = getattr(part, "module", part)  # DDP wraps the stage
        for name in getattr(inner, ELSEWHERE, {}):
            setattr(inner.get_parameter(name), COPY_MARK, True)
