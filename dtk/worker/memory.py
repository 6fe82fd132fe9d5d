"""The plan against the worker's real memory (dtk.plan.cost.predict says what is compared):
each rank's planned bytes as plan.json hands them (dtk.plan.planned_memory), its measurement
(dtk.train.measure.StepMemory), both gathered to rank 0 for summary.json, and the one
line an out-of-memory error stops the job with."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

import torch
import torch.distributed as dist

from dtk.common.rundir import RunDir
from dtk.plan.plan import Plan
from dtk.plan.planned_memory import for_rank, mismatch_event, rank_record, summarize
from dtk.train.measure import StepMemory


class Prediction:
    """This rank's planned bytes as the plan hands them (plan.json's `memory`, made at
    submission), or why there are none."""

    def __init__(self, plan: Plan, *, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.activations_estimated = bool((plan.memory or {}).get("activations_estimated"))
        self.figures, self.error = for_rank(plan.memory, rank=rank, device=device.type, world=plan.world_size,
                                            tasks_per_node=plan.tasks_per_node,
                                            degrees=dataclasses.asdict(plan.degrees))

    def record(self, measured: StepMemory) -> dict[str, Any]:
        if self.figures is None:
            return {"rank": self.rank, "error": self.error}
        return rank_record(self.figures, measured.result(), rank=self.rank, device=self.device.type,
                           activations_estimated=self.activations_estimated)


def measure_index(start_step: int, total_steps: int) -> int:
    """The step measured on the CPU: the second of this start when there is one."""
    return start_step + 1 if total_steps - start_step >= 2 else start_step


def gather_memory(prediction: Prediction, measured: StepMemory, run: RunDir, *, rank: int, world: int,
                  step: int) -> dict[str, Any] | None:
    """Collective: every rank's record to rank 0, which returns summary.json's `memory` and
    writes a `plan_mismatch` event when a rank is off by more than the limit."""
    mine = prediction.record(measured)
    everyone: list[Any] = [mine]  # after the gather: every rank's record
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    errors = [r for r in everyone if "error" in r]
    if errors:
        return {"device": prediction.device.type, "error": errors[0]["error"], "ranks": everyone}
    memory = summarize(everyone, device=prediction.device.type)
    event = mismatch_event(memory)
    if event is not None:
        run.event("plan_mismatch", step=step, **event)
    return memory


def is_out_of_memory(exc: BaseException | None) -> bool:
    """An out-of-memory error, or one raised because of it (a pipeline or compile wrapper)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def oom_error(plan: Plan, *, rank: int, device: torch.device) -> str:
    """The `error:` line's text for an out-of-memory error on this rank: the budget runs again
    here (only here, on the way out), for this device's real memory."""
    from dtk.parallel.count import real_shape
    from dtk.plan.cost.predict import describe_error, oom_line

    host = socket.gethostname()
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    try:
        return oom_line(plan.config, plan, real_shape(plan.config), rank=rank, host=host, device=device.type,
                        capacity=capacity)
    except Exception as exc:  # the line must come out whatever the budget does
        return f"out of memory on rank {rank} ({host}); no memory plan for this job: {describe_error(exc)}"
