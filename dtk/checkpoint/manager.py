"""When to save, what to resume from, what to keep: the checkpoint policy of one worker."""

from __future__ import annotations

import time
from typing import Any

from dtk.checkpoint import dcp as ckpt
from dtk.rundir import RunDir


class CheckpointManager:
    """Every rank holds one; all its methods are collective unless they say otherwise."""

    def __init__(
        self,
        run: RunDir,
        *,
        cfg: dict[str, Any],
        parts: ckpt.Parts,
        scheduler: Any,
        rank: int,
        world_size: int,
        global_batch: int,
        total_steps: int,
        identity: dict[str, Any],
    ) -> None:
        self.run = run
        self.every = cfg["every"]
        self.keep = cfg["keep"]
        self.resume_enabled = cfg["resume"]
        self.parts = parts  # (model part, its optimizer): one pair, or one per pipeline stage held
        self.scheduler = scheduler
        self.rank = rank
        self.world_size = world_size
        self.global_batch = global_batch
        self.total_steps = total_steps
        self.identity = identity  # config hash, data version, scheme: recorded in every checkpoint

    def resume(self) -> int:
        """Load the latest complete checkpoint if there is one; return the step to start from."""
        latest = ckpt.latest_complete(self.run) if self.resume_enabled else None
        if latest is None:
            return 0
        t0 = time.perf_counter()
        state = ckpt.load(latest[1], parts=self.parts)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.rank == 0:
            self.run.event(
                "checkpoint_loaded",
                step=state["step"],
                path=str(latest[1]),
                from_world_size=state["world_size"],
                seconds=round(time.perf_counter() - t0, 3),
            )
        return state["step"]

    def due(self, step: int) -> bool:
        return step == self.total_steps or bool(self.every and step % self.every == 0)

    def save(self, step: int) -> None:
        path = self.run.checkpoint_dir(step)
        state = {
            "step": step,
            "samples_consumed": step * self.global_batch,
            "global_batch": self.global_batch,
            "scheduler": self.scheduler.state_dict(),
            "world_size": self.world_size,
            **self.identity,
        }
        manifest = ckpt.save(path, parts=self.parts, trainer_state=state)
        if self.rank == 0:
            ckpt.prune(self.run, self.keep)
            self.run.event("checkpoint_saved", step=step, path=str(path), seconds=manifest["save_seconds"])

    def on_step_end(self, step: int, _result: Any = None) -> None:
        if self.due(step):
            self.save(step)

    def close(self) -> None:
        """Wait for anything still being written (a no-op while saves are synchronous)."""
