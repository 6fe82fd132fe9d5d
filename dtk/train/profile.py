"""The step profiler of a worker: phase marks, read and gathered every logging interval.

Ties dtk.train.phases (one rank's marks) to dtk.train.straggler (all ranks' numbers): at
`read()`, every rank resolves its marks and one all-gather brings every rank's vectors to
every rank. That is the profiler's only collective and its only host-device
synchronisation, once per `train.log_every` steps. Rank 0 then has, per step, its phases
with the exposed communication and straggler wait split out, per-rank means for the
interval, and the ranks it flags (written to events.jsonl as `straggler`, with the host).

As the `profile` policy (last in `Trainer.fit`'s order) it ends each logging interval on
every rank: read the interval (nothing to read with train.profile=false) and hand it to
the metrics log, which writes the interval's records with their phases.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtk.common.rundir import RunDir
from dtk.train.phases import PhaseTimer
from dtk.train.straggler import Interval, combine


class StepProfiler:
    def __init__(
        self,
        *,
        device: torch.device,
        enabled: bool,
        straggler_factor: float,
        run: RunDir | None,
        rank: int,
        log_every: int,
        total_steps: int,
        metrics: Any,
        saving: Callable[[], bool] | None,
        checkpointed: Callable[[], int | None] | None = None,
    ) -> None:
        # `saving`: whether a background checkpoint write is in flight (it overlaps the step)
        self.timer = PhaseTimer(device=device, enabled=enabled, overlapping=saving)
        self.enabled = enabled
        self.factor = straggler_factor
        self.run = run  # rank 0 writes the straggler events
        self.rank = rank
        self.log_every = log_every
        self.total_steps = total_steps
        self.metrics = metrics  # writes the interval's records (MetricsLog; rank 0 writes)
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._gather_device = device if self._distributed and dist.get_backend() == "nccl" else torch.device("cpu")
        self._hosts: list[str] | None = None
        # the step of the newest checkpoint started: its records are written with it, so a
        # worker killed later never loses the records of steps its restart will not redo
        self.checkpointed = checkpointed

    def hosts(self) -> list[str]:
        """Every rank's host name, gathered once (collective the first time)."""
        if self._hosts is None:
            if self._distributed:
                gathered: list[str | None] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, socket.gethostname())
                self._hosts = [str(h) for h in gathered]
            else:
                self._hosts = [socket.gethostname()]
        return self._hosts

    def read(self) -> Interval | None:
        """Collective on every rank at the same step: the steps since the last read."""
        if not self.enabled:
            return None
        steps = self.timer.collect()
        if not steps:
            return None
        mine = torch.tensor([s.vector() for s in steps], dtype=torch.float64, device=self._gather_device)
        if self._distributed:
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine)
            per_rank = [g.cpu().tolist() for g in gathered]
        else:
            per_rank = [mine.cpu().tolist()]
        interval = combine([s.step for s in steps], per_rank, factor=self.factor, me=self.rank)
        interval.ranks["hosts"] = self.hosts()
        if interval.stragglers and self.run is not None:
            for s in interval.stragglers:
                self.run.event("straggler", step=steps[-1].step, host=interval.ranks["hosts"][s["rank"]],
                               factor=self.factor, **s)
        return interval

    # --- the policy --------------------------------------------------------------------------

    def after_step(self, step: int, result: Any = None) -> None:
        """Every `log_every` steps, at the last, and at a step that was checkpointed (a save is
        collective, so every rank ends the interval there): the records, with their phases."""
        saved = self.checkpointed is not None and self.checkpointed() == step
        if step % self.log_every == 0 or step == self.total_steps or saved:
            self.flush()

    def flush(self) -> None:
        """Collective: read the interval and write its records (also before an agreed stop)."""
        interval = self.read()
        if self.metrics is not None:
            self.metrics.write(interval)

    def close(self) -> None:
        self.timer.close()
