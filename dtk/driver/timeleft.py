"""The driver's own stop before the time limit.

`sbatch --signal=USR2@T` fixes the lead T at submission: the floor before any save was
measured, and a requeue keeps it, so a run whose save outlasts T would be killed in the
middle of its save at every time limit. So the driver watches the time its allocation has
left (Slurm's EndTime, which also follows a changed limit) and stops the workers itself
(USR2 to the step: they agree, save at the next step boundary and exit) once the time left
falls to this run's save + step + margin. The save is the longest one measured so far;
before any, the planner's checkpoint size over the storage throughput the driver measured
at its start. The sbatch signal stays as the backstop.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from dtk.launch.sbatch import SIGNAL_MARGIN_S
from dtk.launch.slurmctl import parse_time_min

TIME_POLL_S = 15.0
"""How often the driver asks Slurm for the job's end time."""
PROBE_BYTES = 32 << 20
"""Written (and fsynced) once at the driver's start to measure the storage throughput."""


def storage_throughput(folder: Path) -> float | None:
    """Bytes per second of a written and fsynced file in `folder` (the run directory)."""
    path = folder / f".throughput_probe.{os.getpid()}"
    block = os.urandom(1 << 20)
    try:
        t0 = time.monotonic()
        with open(path, "wb") as fh:
            for _ in range(PROBE_BYTES >> 20):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        return PROBE_BYTES / max(time.monotonic() - t0, 1e-6)
    except OSError:
        return None
    finally:
        path.unlink(missing_ok=True)


def planned_checkpoint_bytes(plan) -> int | None:
    """The planner's checkpoint size; None when the model cannot be counted here."""
    try:
        from dtk.plan.cost.gate import budget_of

        return budget_of(plan.config, plan).checkpoint_bytes
    except Exception:  # the estimate is a fallback: any failure means "not known"
        return None


def save_estimate_s(plan, folder: Path) -> float | None:
    size, rate = planned_checkpoint_bytes(plan), storage_throughput(folder)
    return size / rate if size and rate else None


def needed_s(run, *, estimate_s: float | None) -> float | None:
    """Save + step + margin from what this run measured (the estimate before any save)."""
    saves = [e["seconds"] for e in run.events_list() if e.get("event") == "checkpoint_saved" and "seconds" in e]
    steps = [r["step_time_s"] for r in run.latest_metrics().values() if "step_time_s" in r]
    save_s = max(saves) if saves else estimate_s
    if save_s is None:
        return None
    return save_s + (statistics.median(steps) if steps else 0.0) + SIGNAL_MARGIN_S


class TimeLeft:
    """`poll()` is True once, when the allocation's time left has fallen to what a stop
    needs; `left_s` and `need_s` say the numbers it decided on."""

    def __init__(self, *, run, slurm, job_id: str, plan) -> None:
        self.run, self.slurm, self.job_id, self.plan = run, slurm, job_id, plan
        self.estimate_s: float | None = None
        self.estimated = False
        self.next_poll = 0.0
        self.left_s = self.need_s = 0.0

    def poll(self) -> bool:
        now = self.slurm.clock.time()
        if now < self.next_poll:
            return False
        self.next_poll = now + TIME_POLL_S
        end = self.slurm.job_end_time(self.job_id)
        if end is None:  # no time limit
            return False
        need = needed_s(self.run, estimate_s=self.estimate_s)
        if need is None and not self.estimated:  # no save measured yet: once, at the driver's start
            self.estimated = True
            self.estimate_s = save_estimate_s(self.plan, self.run.path)
            need = needed_s(self.run, estimate_s=self.estimate_s)
        if need is None:
            return False
        self.left_s, self.need_s = end - now, need
        # Poll again before the moment comes, not up to TIME_POLL_S after it.
        self.next_poll = min(self.next_poll, now + max(1.0, self.left_s - need))
        return self.left_s <= need


def cut_short(slurm, job_id: str) -> bool:
    """Whether Slurm ends the job before its own time limit (EndTime earlier than StartTime
    + TimeLimit): a preemption's grace time, not the limit. False where a field is missing."""
    info = slurm.job_info(job_id) or {}
    try:
        start, end = (time.mktime(time.strptime(info.get(k, ""), "%Y-%m-%dT%H:%M:%S"))
                      for k in ("StartTime", "EndTime"))
        limit_min = parse_time_min(info.get("TimeLimit", ""))
    except ValueError:
        return False
    return limit_min is not None and end < start + limit_min * 60 - 30
