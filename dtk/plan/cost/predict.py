"""The plan held against the run: what each worker predicts for its own rank, how that
compares with what it measured, and the one line an out-of-memory error stops the job with.

The prediction is dtk.plan.cost.memory's, for the job's own scheme at its real size, of the
model the workers really train (the built-in transformer from its config, a user's model
counted on the meta device; the plan.* what-if keys are for planning without a model and
are not used here). What is compared is what each device measures:

- on a GPU, `torch.cuda.max_memory_allocated`: every tensor the caching allocator handed
  out, at the run's peak. Predicted: parameters + gradients + optimizer state + activations
  (with backward's working set) + device buffers; not the margin (the allocator's reserve
  and the CUDA/NCCL runtime are outside what it counts).
- on the CPU, the bytes of live tensors: the states (parameters, gradients, optimizer
  state, counted from the tensors) plus the peak of the tensors kept for backward during
  one step (dtk.train.measure.LiveActivations). Predicted: the states plus the activations
  kept for backward (`activations_saved`), plus FSDP's gathered parameters when every unit's
  are held at the peak (`gathered_kept`: reshard_after_forward=false, or a pipeline).

A gap above MISMATCH (either way) on any rank is a `plan_mismatch` event. The workers compare
the figures plan.json hands them (dtk.plan.planned_memory); the functions here are the same
comparison on the budget's RankBytes, and the budget a worker runs again only for its
out-of-memory line.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dtk.common.errors import UserError
from dtk.plan import planned_memory
from dtk.plan.cost.memory import FRAGMENTATION, RUNTIME_BYTES, RankBytes, rank_bytes
from dtk.plan.planned_memory import MISMATCH as MISMATCH
from dtk.plan.planned_memory import mismatch_event as mismatch_event
from dtk.plan.planned_memory import summarize as summarize

if TYPE_CHECKING:
    from dtk.config.schema import Config
    from dtk.plan.cost.report import MemoryPlan
    from dtk.plan.plan import Plan
    from dtk.plan.shape import ModelShape

def real_context(cfg: Config, plan: Plan, shape: ModelShape, *, device: str, capacity: int | None = None):
    """The budget's inputs as the worker sees them: its real device kind (and, on a GPU, its
    real memory when the config names none), dtk's own accounting (no plan.* keys)."""
    from dtk.plan.cost.inputs import context

    ctx = context(cfg, plan, shape)
    changes: dict[str, Any] = {"device": device, "plan_keys": {}}
    named = cfg.cluster.device_memory_gb or cfg.cluster.accelerator
    if capacity is not None and not named:
        changes.update(capacity=capacity, capacity_source=f"this {device} device ({capacity / 1e9:.1f} GB)")
    return dataclasses.replace(ctx, **changes)


def rank_prediction(cfg: Config, plan: Plan, shape: ModelShape, *, rank: int, device: str) -> RankBytes:
    """dtk.plan's bytes for one rank of this job."""
    from dtk.plan.cost.report import chosen_variant

    ctx = real_context(cfg, plan, shape, device=device)
    return rank_bytes(shape, ctx.job(chosen_variant(ctx, plan)), rank)


def figures(b: RankBytes) -> dict[str, int]:
    """A rank's bytes as plan.json hands them to the workers (dtk.plan.planned_memory.FIGURES)."""
    return {**b.as_dict(), "activations_saved": b.activations_saved, "gathered_kept": b.gathered_kept}


def comparable(b: RankBytes, device: str) -> int:
    """The part of a prediction that the device's measurement sees (see the module doc)."""
    return planned_memory.comparable(figures(b), device)


def rank_record(b: RankBytes, measured: dict[str, int | None], *, rank: int, device: str,
                activations_estimated: bool) -> dict[str, Any]:
    """One rank's prediction against its measurement, for summary.json."""
    return planned_memory.rank_record(figures(b), measured, rank=rank, device=device,
                                      activations_estimated=activations_estimated)


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f}"


def _tighter(mp: MemoryPlan) -> int:
    """The memory a plan must fit in after this job, planned to fit, ran out: its variable
    part (all but the runtime allowance) FRAGMENTATION smaller than this job's."""
    runtime = RUNTIME_BYTES[mp.ctx.device]
    return runtime + round((mp.chosen.bytes.total - runtime) / (1 + FRAGMENTATION))


def oom_line(cfg: Config, plan: Plan, shape: ModelShape, *, rank: int, host: str, device: str,
             capacity: int | None) -> str:
    """The one line an out-of-memory error stops the job with: the planned numbers and the
    overrides that would fit (the budget's recommendation; when the plan said this job fits,
    the recommendation for memory a little under this job's plan)."""
    from dtk.plan.cost.report import memory_plan

    ctx = real_context(cfg, plan, shape, device=device, capacity=capacity)
    mp = memory_plan(ctx, plan)
    b, v = mp.chosen.bytes, mp.chosen.variant
    parts = " + ".join(f"{k} {_gb(getattr(b, k))}" for k in ("params", "grads", "optimizer", "activations",
                                                             "buffers", "margin"))
    text = (f"out of memory on rank {rank} ({host}): planned {_gb(b.total)} GB per device under {mp.key} on"
            f" {v.nodes} node(s) x {v.tasks_per_node} = {parts} GB, against {_gb(ctx.capacity)} GB"
            f" ({ctx.capacity_source})")
    if not shape.has_activation_shape:
        text += "; activations of this model are not estimated"
    if mp.fits:
        tighter = _tighter(mp)
        mp = memory_plan(dataclasses.replace(ctx, capacity=tighter, capacity_source="tighter"), plan)
        text += f"; it needs more than planned: planned again for {_gb(tighter)} GB"
    r = mp.recommended
    # The overrides only (the reason is python -m dtk.plan's): drivers keep 500 characters of the line.
    text += f"; would fit: {' '.join(r.overrides)}" if r.scheme else f"; no override found: {r.reason}"
    return text + "; see python -m dtk.plan"


def describe_error(exc: BaseException) -> str:
    """A budget that cannot be made for the OOM line: why, in a few words."""
    return str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
