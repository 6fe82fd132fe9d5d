"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut into `pp x pp_virtual_stages` stages at unit boundaries (see
`dtk.parallel.units.pipeline_units`): stage s begins at `split_points[s-1]`, or, with no
split points, the blocks are divided evenly and the stages before the first block and
after the last go to the first and last stage. A stage is a copy of the model in which
every unit it does not own is gone: a block becomes `nn.Identity()` (names of the others
stay), a top-level module becomes None (the model's forward must skip None modules).

Pipeline rank r holds stages r, r + pp, r + 2*pp, ... (looped, as interleaved 1F1B
expects). The accumulation micro-batches of one optimizer step are the pipeline's
micro-batches: the schedule runs them all in one `step`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from dtk.config.choices import PipelineSchedule
from dtk.errors import UserError
from dtk.parallel.stage_ties import StageTie, mark_stage, stage_ties
from dtk.parallel.units import pipeline_units
from dtk.plan.layout import local_stage_ids
from dtk.plan.layout import stage_units as cut_stages

SCHEDULES = {
    PipelineSchedule("gpipe"): ScheduleGPipe,
    PipelineSchedule("1f1b"): Schedule1F1B,
    PipelineSchedule("interleaved_1f1b"): ScheduleInterleaved1F1B,
}
MULTI_STAGE = (PipelineSchedule("interleaved_1f1b"),)


def stage_units(model: nn.Module, *, split_points: tuple[str, ...], num_stages: int) -> list[list[str]]:
    """The unit paths of each stage, in order."""
    units = pipeline_units(model)
    names = [name for name, _ in units]
    if split_points:
        if len(split_points) != num_stages - 1:
            raise UserError(
                f"model.split_points has {len(split_points)} entries, which make {len(split_points) + 1} stages,"
                f" but pp x pp_virtual_stages = {num_stages}; give {num_stages - 1} split points or none (even split)"
            )
        missing = [p for p in split_points if p not in names]
        if missing:
            raise UserError(f"model.split_points {missing} are not units of the model; units: {', '.join(names)}")
        starts = [names.index(p) for p in split_points]
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise UserError(f"model.split_points {list(split_points)} must be increasing and after the first unit")
    else:
        num_blocks = sum(1 for _, is_block in units if is_block)
        if num_blocks < num_stages:
            raise UserError(
                f"pp x pp_virtual_stages = {num_stages} stages, but the model has {num_blocks} blocks;"
                " every stage needs at least one"
            )
    return cut_stages(tuple(units), split_points, num_stages)  # the planner's cut, on this model's units


def stage_module(model: nn.Module, keep: list[str]) -> nn.Module:
    """A copy of the (meta) model holding only the units in `keep`."""
    stage = copy.deepcopy(model)
    for name, is_block in pipeline_units(stage):
        if name in keep:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        if is_block:
            parent.register_module(child, nn.Identity())
        else:
            setattr(parent, child, None)
    return stage


def split_model(
    model: nn.Module, *, split_points: tuple[str, ...], pp_rank: int, pp: int, virtual: int
) -> tuple[list[nn.Module], list[int], list[StageTie]]:
    """This pipeline rank's stage modules, their stage indices, and the model's ties that
    span stages (dtk.parallel.stage_ties: each stage records its copies)."""
    units = stage_units(model, split_points=split_points, num_stages=pp * virtual)
    ties = stage_ties(model, units, pp)
    ids = local_stage_ids(pp_rank, pp, virtual)
    stages = [stage_module(model, units[i]) for i in ids]
    for stage in stages:
        mark_stage(stage, ties)
    return stages, ids, ties


def autocast_stage(stage: nn.Module, *, device_type: str, dtype: torch.dtype, sends: bool) -> None:
    """Mixed precision for one pipeline stage, in place: its forward runs under autocast
    (entered by a forward pre-hook, left by a forward hook), so the schedule's backward,
    which runs outside the stage's forward, runs outside autocast as it should. A stage
    that `sends` its output to the next casts it to `dtype` first: half the bytes over the
    pipeline link both ways (the gradient coming back has the output's dtype), and the next
    stage casts what it receives back to float32, so its residual stream stays float32."""
    entered: list = []

    def before(module: nn.Module, args: tuple) -> tuple:
        context = torch.autocast(device_type=device_type, dtype=dtype)
        context.__enter__()
        entered.append(context)
        return tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args)

    def after(module: nn.Module, args: tuple, output):
        entered.pop().__exit__(None, None, None)
        if sends and isinstance(output, torch.Tensor) and output.is_floating_point():
            return output.to(dtype)
        return output

    stage.register_forward_pre_hook(before)
    stage.register_forward_hook(after, always_call=True)


@dataclass
class Pipeline:
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    has_first_stage: bool
    has_last_stage: bool
    stages: list = field(default_factory=list)
    """This rank's PipelineStage objects, in the schedule's order."""

    def after_step(self, hook: Callable[[], None]) -> None:
        """Run `hook` after each schedule step (every micro-batch's backward done)."""
        step = self.schedule.step

        def stepped(*args, **kwargs):
            out = step(*args, **kwargs)
            hook()
            return out

        self.schedule.step = stepped  # type: ignore[method-assign]


def build_pipeline(
    parts: list[nn.Module],
    stage_ids: list[int],
    *,
    num_stages: int,
    schedule: PipelineSchedule,
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    group,
) -> Pipeline:
    stages = [
        PipelineStage(part, stage_index=i, num_stages=num_stages, device=device, group=group)
        for part, i in zip(parts, stage_ids, strict=True)
    ]
    cls = SCHEDULES[schedule]
    # The loss is a mean over one micro-batch; scale_grads divides the summed gradients by
    # the micro-batch count, so the result is the mean over the rank's batch, as without pp.
    if schedule in MULTI_STAGE:
        sched = cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
    else:
        assert len(stages) == 1, "single-stage schedules take one stage per rank"
        sched = cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
    return Pipeline(
        schedule=sched,
        has_first_stage=0 in stage_ids,
        has_last_stage=num_stages - 1 in stage_ids,
        stages=stages,
    )
