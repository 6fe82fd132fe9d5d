"""The training loop: data -> forward/backward with accumulation -> step, then the step's
policies in a fixed order (dtk.train.policies: metrics, heartbeat, resumed, evaluation,
checkpoint, stop, profile). What a micro-batch's loss is, is the run's task (dtk.train.task).

The phase timer (dtk.train.phases) takes a lap at each boundary of a step: data, forward,
backward (and the gradient synchronisation after it), optimizer, comm, then the policies'
checkpoint and the stop agreement. An evaluation between steps is no part of the step.
Laps are marks only (CUDA events or clock readings); the profile policy reads them once
per logging interval. Disabled (train.profile=false), every lap returns at once.

One optimizer step sees the whole global batch; this rank's share arrives as
`grad_accum` micro-batches. Without a pipeline they are run one after another with the
gradient summed; with one, they are the pipeline's micro-batches and the schedule runs
them all. Either way the gradient is the mean over the rank's samples, and the data-
parallel reduction makes it the mean over the global batch - the same number a single
process computes.

The divergence check (dtk.train.divergence) is no policy: it must come before the update.
With it, the loss is reduced before the optimizer step and read on the host with the
gradient norm; a bad step skips the update, and a repeated one raises Rollback (the worker
loads the checkpoint and calls `fit` again) or Diverged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtk.data.loader import StepBatches
from dtk.mesh.mesh import ParallelMesh
from dtk.parallel.grad_norm import clip_grad_norm_
from dtk.parallel.parallelize import Parallelized
from dtk.parallel.precision import autocast
from dtk.parallel.zero import ZeroOptimizer
from dtk.train.divergence import (
    FAIL,
    OK,
    ROLLBACK,
    Diverged,
    DivergenceWatch,
    NanDrill,
    Rollback,
    as_json_number,
    diverged_line,
)
from dtk.train.loss import local_value, sharded_context
from dtk.train.phases import NOT_STEP, PhaseTimer
from dtk.train.policies import StopRequested
from dtk.train.task import LmTask, Task

if TYPE_CHECKING:
    from dtk.train.policies import StepPolicies
    from dtk.train.sync import Synchronizer


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak memory the caching allocator handed out on this rank's GPU; None on the CPU,
    where a process's peak is its resident size, measured from outside (benchmarks/)."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


@dataclass
class StepResult:
    loss: torch.Tensor | float
    """The mean loss over the global batch: a 0-dim tensor on the device, made a float by
    the metrics policy's one host read per `train.log_every` steps (dtk.train.metrics)."""
    lr: float
    grad_norm: torch.Tensor | float
    """The global gradient norm before clipping; a device tensor until read, like `loss`."""
    step_time_s: float
    """Host time of the step. On a GPU the host runs ahead of the device between reads, so
    single steps are not their device time; the read's wait is added to the last step of
    its interval, which makes the interval's sum right."""
    data_wait_s: float
    batch_hash: str
    skipped: str = ""
    """Why the update of this step was skipped (dtk.train.divergence); "" when it was made."""


def tick_after_actions(stage: Any, tick: Callable[[], None]) -> None:
    """Wrap the stage's actions (every schedule runs a micro-batch's forward, backward and
    weight gradient through these methods) so each one that returns calls `tick`."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        action = getattr(stage, name, None)
        if action is None:
            continue

        def ticking(*args, _action=action, **kwargs):
            out = _action(*args, **kwargs)
            tick()
            return out
        setattr(stage, name, ticking)


class Trainer:
    """Runs optimizer steps. Everything distributed is decided before it is built: it gets a
    parallelized model (or a plain module), its own data share, the run's task, and the mesh
    (the loss mean is over its data-parallel ranks, the sum over its pipeline stages)."""

    def __init__(
        self,
        *,
        model: torch.nn.Module | Parallelized,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        scheduler,
        batches: StepBatches,
        task: Task,
        grad_clip: float,
        mesh: ParallelMesh,
        timer: PhaseTimer | None = None,
        around_step: Callable[[int], contextlib.AbstractContextManager] | None = None,
        progress: Callable[[], None] | None = None,
        watch: DivergenceWatch | None = None,
        nan_drill: NanDrill | None = None,
        event: Callable[..., None] | None = None,
        sync: Synchronizer | None = None,
    ) -> None:
        if not isinstance(model, Parallelized):
            model = Parallelized(parts=[model], pipeline=None, autocast_dtype=None, loss_parallel=False)
        self.parallel = model
        self.parts = model.parts
        self.model = model.parts[0]
        self.optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        self.scheduler = scheduler
        self.batches = batches
        self.task = task
        self.grad_clip = grad_clip
        self.mesh = mesh
        self._params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        self.timer = timer if timer is not None else PhaseTimer(device=batches.device, enabled=False)
        # The moment the last gradient is ready: sync begins. Parameters in host memory while
        # the step runs on a GPU are FSDP's CPU offload, whose gradient copies one hook spares.
        offloaded = batches.device.type != "cpu" and any(p.device.type == "cpu" for p in self._params)
        self.timer.watch_gradients(self._params, one=offloaded)
        # Wraps each step's forward and backward (0-based step): dtk.train.measure.StepMemory
        # measures one of them against the plan.
        self.around_step = around_step or (lambda step: contextlib.nullcontext())
        # Called after each micro-batch and each pipeline action: the heartbeat's ticks, so a
        # step of many micro-batches is progress all along, not one silent stretch.
        self.progress = progress or (lambda: None)
        if model.pipeline is not None:
            for stage in model.pipeline.stages:
                tick_after_actions(stage, self.progress)
        # The divergence check (dtk.train.divergence): None, no check and no host read per step.
        self.watch = watch
        self.nan_drill = nan_drill  # rank 0: `dtk.drill nan` requests
        self.event = event or (lambda name, **details: None)  # rank 0 writes events.jsonl
        self.sync = sync  # +sync: the replicas synchronize every sync.every steps (dtk.train.sync)

    def _sync_context(self, last_micro: bool):
        """Skip gradient traffic that would be repeated on the next micro-batch anyway."""
        no_sync = getattr(self.model, "no_sync", None)
        if no_sync is not None:  # DDP: all-reduce only after the last micro-batch
            return no_sync() if not last_micro else contextlib.nullcontext()
        set_requires_all_reduce = getattr(self.model, "set_requires_all_reduce", None)
        if set_requires_all_reduce is not None:
            # FSDP: reduce-scatter every micro-batch (gradients stay sharded), but the HSDP
            # all-reduce across replicas only once, on the summed shards.
            set_requires_all_reduce(last_micro)
        return contextlib.nullcontext()

    def _autocast(self):
        return autocast(self.batches.device, self.parallel.autocast_dtype)

    def _accumulate(self, micro: list[Any]) -> torch.Tensor:
        """Forward/backward of each micro-batch; returns the mean loss over them."""
        total = torch.zeros((), device=self.batches.device)
        n = len(micro)
        for i, batch in enumerate(micro):
            with self._sync_context(i == n - 1):
                loss = self.task(self.model, batch, self._autocast())
                self.timer.lap("forward")
                with sharded_context(loss):  # a loss of vocabulary-sharded logits: its backward too
                    (loss / n).backward()
                self.timer.lap("backward")
            total += local_value(loss.detach()).float()
            self.progress()
        return total / n

    def _pipeline(self, micro: list[torch.Tensor]) -> torch.Tensor:
        """One schedule step over all micro-batches; the mean loss on the last stage, 0 elsewhere."""
        pipe = self.parallel.pipeline
        assert pipe is not None, "called for a pipelined model only"
        assert isinstance(self.task, LmTask), "the plan refuses a pipeline for other tasks"
        inputs, targets = self.task.split(torch.cat(micro))
        args = (inputs,) if pipe.has_first_stage else ()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if pipe.has_last_stage else {}
        # No autocast here: each stage's forward enters it (dtk.parallel.pipeline.autocast_stage),
        # and the backward the schedule runs between forwards stays outside it.
        pipe.schedule.step(*args, **kwargs)
        self.timer.lap("backward")  # the schedule interleaves forward and backward: one lap
        if not pipe.has_last_stage:
            return torch.zeros((), device=inputs.device)
        mean = torch.stack([local_value(loss.detach()).float() for loss in losses]).mean()
        # Context parallel: each micro-batch's loss is the mean over this rank's slice of the
        # sequence; every cp rank holds as many tokens, so the step's loss is the mean over cp.
        return mean if self.task.cp is None else self.task.cp.mean(mean)

    def _global_mean(self, local: torch.Tensor) -> torch.Tensor:
        # Pipeline: only the last stage has the loss; summing over stages gives it to all
        # (global rank 0, which logs, holds the first stage).
        pp_group, dp_group = self.mesh.pp_group, self.mesh.dp_group
        if self.parallel.pipeline is not None and pp_group is not None:
            dist.all_reduce(local, group=pp_group)
        # Every data-parallel rank saw the same number of samples, so the mean of the rank
        # means is the mean over the global batch.
        if dp_group is not None:
            dist.all_reduce(local, group=dp_group)
            local /= self.mesh.dp_size
        return local  # no .item(): the host does not wait for the device here

    def step(self, step: int) -> StepResult:
        """One optimizer step over the global batch of `step` (0-based)."""
        t0 = time.perf_counter()
        self.timer.begin(step + 1)  # keyed as the records are: steps completed after it
        micro = self.batches.get(step)
        t_data = time.perf_counter() - t0
        self.timer.lap("data")
        with self.around_step(step):
            if self.parallel.pipeline is not None:
                local = self._pipeline(micro)
            else:
                local = self._accumulate(micro)
        if self.nan_drill is not None and self.nan_drill.poisoned(step + 1):
            local = local + float("nan")  # rank 0's share: the global mean is NaN on every rank
        for optimizer in self.optimizers:  # ZeRO-1 without DDP (tensor parallel): the mean over dp, before clipping
            if isinstance(optimizer, ZeroOptimizer) and optimizer.reduces_gradients:
                optimizer.reduce_gradients()
        grad_norm = clip_grad_norm_(self._params, self.grad_clip, pp_group=self.mesh.pp_group)
        lr = self.scheduler.get_last_lr()[0]
        batch_hash = self.batches.global_hash(step)
        if self.watch is not None:
            loss = self._global_mean(local)  # before the update: the verdict is the same on every rank
            skipped = self._check(step + 1, loss, grad_norm, batch_hash)
            if skipped:
                self.timer.lap("optimizer")
                return StepResult(loss=loss, lr=lr, grad_norm=grad_norm, step_time_s=time.perf_counter() - t0,
                                  data_wait_s=t_data, batch_hash=batch_hash, skipped=skipped)
        for optimizer in self.optimizers:
            optimizer.step()
        self.scheduler.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.timer.lap("optimizer")
        if self.watch is None:
            loss = self._global_mean(local)
        self.timer.lap("comm")
        return StepResult(
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            step_time_s=time.perf_counter() - t0,
            data_wait_s=t_data,
            batch_hash=batch_hash,
        )

    def _check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, batch_hash: str) -> str:
        """The divergence verdict of `step` (completed steps after it): "" to update, else why
        the update is skipped; raises Rollback or Diverged. One host read of both values."""
        assert self.watch is not None
        loss_v, norm_v = torch.stack([loss.detach().float(), grad_norm.detach().float().to(loss.device)]).tolist()
        verdict = self.watch.observe(step, loss_v, norm_v, batch_hash)
        if verdict.action == OK:
            return ""
        for optimizer in self.optimizers:  # no optimizer step, no scheduler step
            optimizer.zero_grad(set_to_none=True)
        self.event("skipped_update", step=step, cause=verdict.cause(), batch_hash=batch_hash,
                   data_step=self.batches.data_step(step - 1), loss=as_json_number(loss_v),
                   grad_norm=as_json_number(norm_v))
        if verdict.action == ROLLBACK:
            self.timer.end()
            raise Rollback(verdict.bad)
        if verdict.action == FAIL:
            line = diverged_line(verdict.bad, rollbacks=self.watch.rollbacks_done,
                                 reason=f"fault.max_rollbacks={self.watch.max_rollbacks} reached")
            self.event("diverged", step=step, steps=[b.step for b in verdict.bad],
                       batch_hashes=[b.batch_hash for b in verdict.bad])
            raise Diverged(line)
        return verdict.cause()

    def fit(self, *, start_step: int, total_steps: int, policies: StepPolicies) -> StepResult | None:
        """Train steps [start_step, total_steps). After each, the policies run in this order;
        `step` is the number of optimizer steps completed."""
        result = None
        lap = self.timer.lap
        for index in range(start_step, total_steps):
            result = self.step(index)  # laps: data, forward, backward (+ sync), optimizer, comm
            step = index + 1
            if self.sync is not None:  # before the policies: a checkpoint sees the synchronized state
                self.sync.after_step(step, result)
                lap("comm")
            policies.metrics.after_step(step, result)  # the step's metrics.jsonl record, kept
            policies.heartbeat.after_step(step, result)  # the driver's liveness file
            policies.resumed.after_step(step, result)  # once after a restart: the recovery is over
            lap("optimizer")  # (the bookkeeping above: microseconds)
            policies.evaluation.after_step(step, result)  # validation loss every train.eval_every
            lap(NOT_STEP)
            policies.checkpoint.after_step(step, result)  # a save every checkpoint.every (or minutes)
            lap("checkpoint")  # the blocking part of a save
            policies.heartbeat.after_step(step, result)  # an evaluation or a save may have been long
            try:
                policies.stop.after_step(step, result)  # a signal on any rank: all agree, save, stop
            except StopRequested:
                lap("checkpoint")  # the stop's save, committed
                self.timer.end()
                policies.profile.flush()  # every rank stops at this step: its records are written first
                raise
            lap("comm")  # the stop agreement is a collective
            self.timer.end()
            policies.profile.after_step(step, result)  # every train.log_every steps: phases, ranks, records
        return result
