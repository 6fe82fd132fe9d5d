"""Across ranks: split each step's synchronisation wait into communication and waiting for the
slowest rank, and flag ranks much slower than the others.

Every rank measured, per step, `sync`: from its own last gradient being ready to the end
of the gradient reduction. The slowest rank arrives last and waits only for the transfer
itself, so per step the least `sync` over the ranks is the exposed communication, and what
a rank waited beyond it is the `straggler` phase: time lost to another rank's lateness.
No clocks are compared across hosts, only durations each rank measured itself.

A rank's busy time is its step time less that straggler wait. A rank whose busy time over
a logging interval exceeds the median rank's by `fault.straggler_factor` is flagged. The
low median is used so that with two ranks the slow one is compared with the fast one.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from dtk.common.rundir import IDLE_PHASES, PHASES
from dtk.train.phases import LAPS

_TOTAL = 0
_COL = {name: i + 1 for i, name in enumerate(LAPS)}


@dataclass
class Interval:
    """What rank 0 logs for the steps of one gathered interval."""

    phases: dict[int, dict[str, float]]
    """Per step: rank 0's phases (seconds), `comm` including its exposed share of the reduction."""
    step_time_s: dict[int, float]
    ranks: dict[str, list[Any]]
    """Per rank, mean over the interval: `step_time_s`, `busy_s` (less straggler wait), `wait_s`,
    and each phase as `<phase>_s` (`forward_s`, ...: where a slow rank's time goes)."""
    stragglers: list[dict[str, Any]]
    """Ranks flagged in this interval: rank, busy seconds, ratio to the median."""


def combine(steps: list[int], per_rank: list[list[list[float]]], *, factor: float, me: int = 0) -> Interval:
    """`per_rank[r][i]`: rank r's vector (StepTimes.vector) for `steps[i]`."""
    num_ranks = len(per_rank)
    phases: dict[int, dict[str, float]] = {}
    totals: dict[int, float] = {}
    waits = [[0.0] * len(steps) for _ in range(num_ranks)]
    sums = [dict.fromkeys(PHASES, 0.0) for _ in range(num_ranks)]  # per rank, over the interval
    for i, step in enumerate(steps):
        syncs = [per_rank[r][i][_COL["sync"]] for r in range(num_ranks)]
        exposed = min(syncs)
        for r in range(num_ranks):
            waits[r][i] = syncs[r] - exposed
            ph = {p: per_rank[r][i][_COL[p]] for p in PHASES if p in _COL}
            ph["comm"] += exposed
            ph["straggler"] = waits[r][i]
            for p in PHASES:
                sums[r][p] += ph[p]
            if r == me:
                phases[step] = ph
        totals[step] = per_rank[me][i][_TOTAL]
    step_times = [statistics.fmean(per_rank[r][i][_TOTAL] for i in range(len(steps))) for r in range(num_ranks)]
    wait_means = [statistics.fmean(w) for w in waits]
    busy = [t - w for t, w in zip(step_times, wait_means, strict=True)]
    ranks = {"step_time_s": step_times, "busy_s": busy, "wait_s": wait_means}
    ranks.update({f"{p}_s": [sums[r][p] / len(steps) for r in range(num_ranks)] for p in PHASES})
    return Interval(phases=phases, step_time_s=totals, ranks=ranks, stragglers=flag(busy, factor=factor))


def flag(busy: list[float], *, factor: float) -> list[dict[str, Any]]:
    """Ranks whose busy time exceeds the (low) median's by `factor`."""
    if len(busy) < 2 or factor <= 0:
        return []
    median = statistics.median_low(busy)
    if median <= 0:
        return []
    return [
        {"rank": r, "busy_s": round(b, 6), "median_s": round(median, 6), "ratio": round(b / median, 3)}
        for r, b in enumerate(busy)
        if b > factor * median
    ]


def idle_share(phases: dict[str, float], step_time: float) -> float:
    return sum(phases[p] for p in IDLE_PHASES) / step_time if step_time > 0 else 0.0
