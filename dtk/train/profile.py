"""The step profiler of a worker: phase marks, read and gathered every logging interval.

Ties dtk.train.phases (one rank's marks) to dtk.train.straggler (all ranks' numbers): at
`read()`, every rank resolves its marks and one all-gather brings every rank's vectors to
every rank. That is the profiler's only collective and its only host-device
synchronisation, once per `train.log_every` steps. Rank 0 then has, per step, its phases
with the exposed communication and straggler wait split out, per-rank means for the
interval, and the ranks it flags (written to events.jsonl as `straggler`, with the host).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from dtk.rundir import RunDir
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
    ) -> None:
        self.timer = PhaseTimer(device=device, enabled=enabled)
        self.enabled = enabled
        self.factor = straggler_factor
        self.run = run  # rank 0 writes the straggler events
        self.rank = rank
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._gather_device = device if self._distributed and dist.get_backend() == "nccl" else torch.device("cpu")
        self._hosts: list[str] | None = None

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
        if interval.stragglers:
            hosts = self.hosts()
            if self.run is not None:
                for s in interval.stragglers:
                    self.run.event("straggler", step=steps[-1].step, host=hosts[s["rank"]], factor=self.factor, **s)
        return interval

    def close(self) -> None:
        self.timer.close()

