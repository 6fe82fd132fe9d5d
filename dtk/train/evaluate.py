"""Validation loss (and the task's metrics) every `train.eval_every` steps, logged to
RUN_DIR/eval.jsonl by rank 0.

The validation set is the first samples of the validation split, a whole number of global
batches, each split over the data-parallel ranks like a training batch - so every rank
runs the same number of forwards (FSDP and DDP need that) and the samples evaluated do
not depend on the world size. The loss is the mean over every target token of them
(token LM) or over every sample (a user's task, whose metrics are means over samples too).

eval.jsonl holds one line per evaluation: step, val_loss, val_NAME for each metric of the
task, val_samples, seconds. It is a file of its own so that metrics.jsonl stays one record
per training step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dtk.common.rundir import append_jsonl
from dtk.data.batch import as_torch, micro_batches, to_device
from dtk.data.order import rank_share
from dtk.mesh.mesh import ParallelMesh
from dtk.parallel.precision import autocast
from dtk.plan.plan import check_eval_split
from dtk.train.task import Task


class Evaluator:
    def __init__(
        self,
        *,
        model: torch.nn.Module,
        dataset: Any,
        task: Task,
        every: int,
        total_steps: int,
        max_samples: int,
        global_batch: int,
        micro_batch: int,
        mesh: ParallelMesh,
        device: torch.device,
        log: Path | None,
        stop_requested: Callable[[], bool] | None,
        autocast_dtype: torch.dtype | None,
    ) -> None:
        self.model = model
        self.task = task
        self.dataset = dataset
        self.every = every
        self.total_steps = total_steps
        self.num_samples = check_eval_split(len(dataset), every=every, max_samples=max_samples,
                                            global_batch=global_batch)
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.mesh = mesh
        self.device = device
        self.log = log  # rank 0 only
        # Collective, checked before every validation batch: a long evaluation must not
        # outlast the lead time of a time-limit or preemption signal.
        self.stop_requested = stop_requested
        self.autocast_dtype = autocast_dtype  # the training forward's autocast (dtk.parallel.precision)

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.total_steps)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Collective over the data-parallel group: {"val_loss": mean per token (or sample),
        "val_NAME": each metric's mean}, or None when a stop was agreed on part-way (the
        step's end then saves and stops)."""
        was_training = self.model.training
        self.model.eval()
        names = ["loss", *self.task.metrics]
        # per name: sum, count - on the device, read once at the end, not every batch
        total = torch.zeros(2 * len(names), dtype=torch.float64, device=self.device)
        try:
            for start in range(0, self.num_samples, self.global_batch):
                if self.stop_requested is not None and self.stop_requested():
                    return None
                ids = rank_share(np.arange(start, start + self.global_batch), self.mesh.dp_rank, self.mesh.dp_size)
                for micro in micro_batches(as_torch(self.dataset.get(ids)), self.micro_batch):
                    with autocast(self.device, self.autocast_dtype):  # the training forward's
                        sums, counts = self.task.sums(self.model, to_device(micro, self.device))
                    for j, name in enumerate(names):
                        total[2 * j] += sums[name].double()
                        total[2 * j + 1] += counts[name]
        finally:
            self.model.train(was_training)
        if self.mesh.dp_group is not None:
            dist.all_reduce(total, group=self.mesh.dp_group)
        values = total.tolist()
        return {f"val_{name}": values[2 * j] / values[2 * j + 1] for j, name in enumerate(names)}

    def after_step(self, step: int, _result: Any = None) -> float | None:
        if not self.due(step):
            return None
        t0 = time.perf_counter()
        values = self.evaluate()
        if values is None:
            return None
        seconds = time.perf_counter() - t0
        if self.log is not None:
            append_jsonl(
                self.log, {"step": step, **values, "val_samples": self.num_samples, "seconds": round(seconds, 4)}
            )
            shown = " ".join(f"{k} {v:.4f}" for k, v in values.items())
            print(f"eval step {step} {shown} ({self.num_samples} samples, {seconds:.2f} s)", flush=True)
        return values["val_loss"]
