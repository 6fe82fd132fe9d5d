"""The training loop: data → forward/backward with accumulation → step → metrics → checkpoint."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtk.data.loader import StepBatches
from dtk.train.metrics import MetricsLog


@dataclass
class StepResult:
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    data_wait_s: float
    batch_hash: str


class Trainer:
    """Runs optimizer steps. Everything distributed is decided before it is built: it gets a
    parallelized model, its own data share and a process group for the loss mean."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        batches: StepBatches,
        grad_clip: float,
        dp_group: dist.ProcessGroup | None,
        metrics: MetricsLog | None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.batches = batches
        self.grad_clip = grad_clip
        self.dp_group = dp_group
        self.metrics = metrics
        self._params = [p for p in model.parameters() if p.requires_grad]

    def _sync_context(self, last_micro: bool):
        # DDP all-reduces gradients in backward; on all but the last micro-batch of the
        # accumulation that traffic is wasted, so skip it.
        if not last_micro and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def step(self, step: int) -> StepResult:
        """One optimizer step over the global batch of `step` (0-based)."""
        t0 = time.perf_counter()
        micro = self.batches.get(step)
        t_data = time.perf_counter() - t0
        total = torch.zeros((), device=micro[0][0].device)
        n = len(micro)
        for i, (inputs, targets) in enumerate(micro):
            with self._sync_context(i == n - 1):
                logits = self.model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                (loss / n).backward()
            total += loss.detach()
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(self._params, self.grad_clip, foreach=True)
            if self.grad_clip > 0
            else torch.zeros(())
        )
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        mean = total / n
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            # Every data-parallel rank saw the same number of samples, so the mean of the
            # rank means is the mean over the global batch.
            dist.all_reduce(mean, group=self.dp_group)
            mean /= dist.get_world_size(self.dp_group)
        loss_value = mean.item()
        return StepResult(
            loss=loss_value,
            lr=lr,
            grad_norm=float(grad_norm),
            step_time_s=time.perf_counter() - t0,
            data_wait_s=t_data,
            batch_hash=self.batches.global_hash(step),
        )

    def fit(
        self,
        *,
        start_step: int,
        total_steps: int,
        on_step_end: Callable[[int, StepResult], None] | None = None,
    ) -> StepResult | None:
        """Train steps [start_step, total_steps); `on_step_end(completed, result)` after each."""
        result = None
        for step in range(start_step, total_steps):
            result = self.step(step)
            if self.metrics is not None:
                self.metrics.step(step + 1, result)
            if on_step_end is not None:
                on_step_end(step + 1, result)
        return result

