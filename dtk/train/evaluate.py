"""Validation loss every `train.eval_every` steps, logged to RUN_DIR/eval.jsonl by rank 0.

The validation set is the first samples of the validation split, a whole number of global
batches, each split over the data-parallel ranks like a training batch - so every rank
runs the same number of forwards (FSDP and DDP need that) and the samples evaluated do
not depend on the world size. The loss is the mean over every target token of them.

eval.jsonl holds one line per evaluation: step, val_loss, val_samples, seconds. It is a
file of its own so that metrics.jsonl stays one record per training step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dtk.data.order import rank_share
from dtk.dist.mesh import ParallelMesh
from dtk.errors import UserError
from dtk.rundir import append_jsonl
from dtk.train.loss import Loss

EVAL_LOG = "eval.jsonl"


class Evaluator:
    def __init__(
        self,
        *,
        model: torch.nn.Module,
        dataset: Any,
        loss: Loss,
        every: int,
        total_steps: int,
        max_samples: int,
        global_batch: int,
        micro_batch: int,
        mesh: ParallelMesh,
        device: torch.device,
        log: Path | None,
        stop_requested: Callable[[], bool] | None,
    ) -> None:
        self.model = model
        self.loss = loss
        self.dataset = dataset
        self.every = every
        self.total_steps = total_steps
        usable = len(dataset) if max_samples <= 0 else min(len(dataset), max_samples)
        self.num_samples = usable // global_batch * global_batch
        if every > 0 and self.num_samples == 0:
            raise UserError(
                f"train.eval_every={every}: the validation split has {len(dataset)} samples (evaluating at most"
                f" {usable}), fewer than one global batch of {global_batch}; hold out more"
                " (data.val_fraction, data.val_shards, data.eval_samples) or set train.eval_every=0"
            )
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.mesh = mesh
        self.device = device
        self.log = log  # rank 0 only
        # Collective, checked before every validation batch: a long evaluation must not
        # outlast the lead time of a time-limit or preemption signal.
        self.stop_requested = stop_requested

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.total_steps)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Collective over the data-parallel group: the mean validation loss per token, or
        None when a stop was agreed on part-way (the step's end then saves and stops)."""
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)  # loss sum, token count
        try:
            for start in range(0, self.num_samples, self.global_batch):
                if self.stop_requested is not None and self.stop_requested():
                    return None
                ids = rank_share(np.arange(start, start + self.global_batch), self.mesh.dp_rank, self.mesh.dp_size)
                rows = torch.from_numpy(self.dataset.get(ids))
                for i in range(0, len(rows), self.micro_batch):
                    micro = rows[i : i + self.micro_batch].to(self.device)
                    summed, count = self.loss.total(self.model(micro[:, :-1]), micro[:, 1:])
                    total[0] += summed.double().cpu()
                    total[1] += count
        finally:
            self.model.train(was_training)
        if self.mesh.dp_group is not None:
            reduced = total.to(self.device)
            dist.all_reduce(reduced, group=self.mesh.dp_group)
            total = reduced.cpu()
        return float(total[0] / total[1])

    def after_step(self, step: int, _result: Any = None) -> float | None:
        if not self.due(step):
            return None
        t0 = time.perf_counter()
        val_loss = self.evaluate()
        if val_loss is None:
            return None
        seconds = time.perf_counter() - t0
        if self.log is not None:
            append_jsonl(
                self.log,
                {"step": step, "val_loss": val_loss, "val_samples": self.num_samples, "seconds": round(seconds, 4)},
            )
            print(f"eval step {step} val_loss {val_loss:.4f} ({self.num_samples} samples, {seconds:.2f} s)", flush=True)
        return val_loss
