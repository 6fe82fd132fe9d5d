"""Per-step metrics: one JSON line per step in metrics.jsonl (global rank 0 only)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from dtk.rundir import append_jsonl


class MetricsLog:
    """The metrics policy: one record per step and a progress line every `log_every` steps,
    on global rank 0 (`path` None on the others: nothing)."""

    def __init__(
        self, path: Path | None, *, world_size: int, restart: int, tokens_per_step: int, total_steps: int,
        log_every: int,
    ) -> None:
        self.path = path
        self.world_size = world_size
        self.restart = restart
        self.tokens_per_step = tokens_per_step
        self.total_steps = total_steps
        self.log_every = log_every

    def after_step(self, step: int, result: Any) -> None:
        if self.path is not None:
            self.step(step, result)

    def step(self, step: int, result: Any) -> None:
        record: dict[str, Any] = {
            "step": step,
            "time": round(time.time(), 3),
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": round(result.grad_norm, 6),
            "world_size": self.world_size,
            "restart": self.restart,
            "step_time_s": round(result.step_time_s, 6),
            "data_wait_s": round(result.data_wait_s, 6),
            "tokens_per_s": round(self.tokens_per_step / max(result.step_time_s, 1e-9), 1),
            "batch_hash": result.batch_hash,
        }
        append_jsonl(self.path, record)
        if step % self.log_every == 0 or step == self.total_steps:
            print(
                f"step {step}/{self.total_steps} loss {result.loss:.4f} lr {result.lr:.2e}"
                f" {result.step_time_s * 1000:.1f} ms/step",
                file=sys.stdout,
                flush=True,
            )
