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

What a step holds does not grow with its micro-batches (only with those in flight, at most
pp under 1F1B):

- the last stage computes each micro-batch's loss right after its forward, inside the
  schedule, and keeps no logits once that micro-batch's backward is done: the schedule's
  step never returns the outputs (torch would keep every micro-batch's logits to merge
  them). Under tensor parallelism the logits stay sharded over the vocabulary and the loss
  and its backward run on the shards (torch's loss_parallel), as without a pipeline;
- a stage's receive buffers (the activation from the previous stage, the gradient from the
  next) exist only from the receive of their micro-batch to the end of its backward
  (`FreeingStage`); torch allocates one of each per micro-batch and keeps them;
- the loss of a micro-batch, which the schedule keeps to the step's end, is detached after
  its backward: its graph would hold the micro-batch's receive buffer (a leaf it
  accumulates into) until then.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor.parallel import loss_parallel

from dtk.common.errors import UserError
from dtk.config.choices import PipelineSchedule
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


def _release(infos) -> None:
    """Drop the receive buffers of one micro-batch (and the gradient an activation buffer
    collected as a leaf of the stage's backward)."""
    for info in infos:
        if not info.is_root_arg and info.buffer is not None:
            info.buffer.grad = None
            info.buffer = None


def _allocate(infos, device: torch.device) -> None:
    for info in infos:
        if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
            info.buffer = _make_tensor_from_meta(info.tensor_meta, device)


class FreeingStage(PipelineStage):
    """A PipelineStage whose receive buffers live from the receive of their micro-batch to
    the end of its backward. A buffer is allocated when the schedule posts its receive and
    dropped when the micro-batch's backward is done (its gradient, if any, is then held by
    the pending send alone), so a step holds the buffers of the micro-batches in flight,
    not one per micro-batch of the step."""

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(1, has_backward)  # one micro-batch's receive infos, as torch makes them
        first = self.args_recv_info[0]
        _release(first)
        for chunk in range(1, num_microbatches):
            self.args_recv_info[chunk] = tuple(copy.copy(info) for info in first)

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
        infos = super()._create_grad_recv_info(act_send_info)
        _release(infos)
        return infos

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        _allocate(self.args_recv_info[fwd_chunk_id], self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        if self.has_backward and not self.is_last:
            _allocate(self.grad_recv_info[bwd_chunk_id], self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                   last_backward=last_backward)
        if full_backward and self.has_backward:  # the inputs' gradients are in bwd_cache, for the send
            _release(self.args_recv_info[bwd_chunk_id])
            _release(self.grad_recv_info.get(bwd_chunk_id, ()))
        if loss is not None and not loss._is_view():
            # The schedule keeps each micro-batch's loss to the step's end; its graph's nodes
            # (freed of their saved tensors, not of the leaves they accumulate into) would keep
            # this micro-batch's receive buffer alive with it.
            loss.detach_()


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
    sharded_loss: bool = False,
) -> Pipeline:
    """The schedule over this rank's stages. Its `step` computes each micro-batch's loss on
    the last stage as the micro-batch comes and returns no outputs; `sharded_loss`: the
    last stage's logits are sharded over the vocabulary (tensor parallel), so the loss and
    its backward run under loss_parallel."""
    stages = [
        FreeingStage(part, stage_index=i, num_stages=num_stages, device=device, group=group)
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
    has_last = num_stages - 1 in stage_ids
    step = sched.step

    def per_micro_batch_step(*args, **kwargs):
        kwargs["return_outputs"] = False  # the schedule would keep every micro-batch's logits to merge them
        with loss_parallel() if sharded_loss and has_last else contextlib.nullcontext():
            return step(*args, **kwargs)

    sched.step = per_micro_batch_step
    return Pipeline(
        schedule=sched,
        has_first_stage=0 in stage_ids,
        has_last_stage=has_last,
        stages=stages,
    )
