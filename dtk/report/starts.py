"""Why each start of a run began, what it resumed from, what it redid, and how long training
was down before it: the per-start history `python -m dtk.status` prints.

Derived from the run directory alone (events.jsonl and every metrics.jsonl record, including
the earlier record of a step that was computed again). Pure: no torch, no I/O.

Per start:
    cause         why it began: the first start; or the event that ended the start before it
                  (crashed, hung, node failed, preempted or a time limit, grown back, stopped and
                  submitted again)
    resumed_from  the checkpoint step it loaded (0: it started from scratch)
    tier          where that state came from: memory, peer or disk (None: from scratch), and
                  memory_fallback, why a start with checkpoint.memory_every loaded from disk
    steps_redone  steps the start before had done past that checkpoint (computed again)
    downtime_s    from the last step on record before the fault to this start's first step,
                  so a hang's detection wait and the queue wait of a requeue are counted
    budget_left   crash or hang relaunches left in this allocation (fault.max_restarts)
"""

from __future__ import annotations

from typing import Any

from dtk.report.goodput import last_step_of, resumed_from, start_segments, tier_of


def _cause(before: list[dict[str, Any]], current: list[dict[str, Any]]) -> str:
    """The cause of a start from the events of the start before it (and its own `grown`)."""
    if any(e.get("event") == "grown" for e in current):
        grown = next(e for e in current if e.get("event") == "grown")
        return f"grown back to world {grown.get('world_size')} (from {grown.get('from_world_size')})"
    kinds = {e.get("event"): e for e in before}
    if "relaunched" in kinds:
        e = kinds["relaunched"]
        where = f"rank {e['rank']} on {e.get('host')}, " if e.get("rank") is not None else ""
        return f"{e.get('cause')}: {where}{e.get('detail')}" if e.get("detail") else str(e.get("cause"))
    if "node_failed" in kinds:
        return f"node failed: {','.join(kinds['node_failed'].get('nodes') or [])}"
    if "node_returned" in kinds:
        return f"node returned: {','.join(kinds['node_returned'].get('nodes') or [])}"
    if "time_limit_near" in kinds:
        if kinds["time_limit_near"].get("preempted"):  # Slurm ended the job before its limit: a grace time
            return "preempted (stopped by the driver within Slurm's grace time)"
        return "time limit (stopped by the driver before it)"
    if "stopped" in kinds:  # the workers' `preempted` on the stop's SIGTERM is no preemption
        return f"stopped ({kinds['stopped'].get('by') or '?'}), then submitted again"
    if "resubmitted" in kinds:  # PreemptMode=CANCEL: the driver submitted the run as a new job
        return f"preempted (job {kinds['resubmitted'].get('after_job')} cancelled), resubmitted as a new job"
    if "preempted" in kinds:
        reason = (kinds.get("requeued") or {}).get("reason") or ""
        signal = kinds["preempted"].get("signal")
        if "time limit" in reason or signal == "SIGUSR2":
            return "time limit"
        return f"preempted ({signal})" if signal else "preempted"
    if "requeued" in kinds:
        return f"requeued: {kinds['requeued'].get('reason')}"
    for kind in ("failed", "finished"):
        if kind in kinds:
            return f"{kind}, then submitted again"
    return "ended without a recorded cause (the driver was killed?)"


def history(events: list[dict[str, Any]], metric_lines: list[dict[str, Any]], *, max_restarts: int) -> list[dict[str, Any]]:
    """One dict per start, oldest first (the fields in the module doc string)."""
    events = sorted((e for e in events if "time" in e), key=lambda e: float(e["time"]))
    groups = start_segments(events)
    by_restart: dict[Any, list[dict[str, Any]]] = {}
    for r in metric_lines:
        if "time" in r and "step" in r:
            by_restart.setdefault(r.get("restart"), []).append(r)
    out: list[dict[str, Any]] = []
    budget = max_restarts
    for i, group in enumerate(groups):
        started = group[0]
        records = by_restart.get(started.get("restart"), [])
        info: dict[str, Any] = {
            "restart": started.get("restart"),
            "job_id": started.get("job_id"),
            "nodes": started.get("nodes"),
            "world_size": started.get("world_size"),
            "resumed_from": resumed_from(group),
            "tier": tier_of(group),
        }
        # why a start with the tier on did not restore from it: on its disk load's event, or, with
        # nothing on disk either, an event of its own
        fallback = next((e.get("memory_fallback") if e.get("event") == "checkpoint_loaded" else e.get("reason")
                         for e in group if e.get("event") in ("checkpoint_loaded", "memory_fallback")), None)
        if fallback:
            info["memory_fallback"] = fallback
        if "slurm_restart_count" in started:
            info["slurm_restart_count"] = started["slurm_restart_count"]
        if i == 0:
            info["cause"] = "first start"
            budget = max_restarts
        else:
            before = groups[i - 1]
            info["cause"] = _cause(before, group)
            relaunch = next((e for e in reversed(before) if e.get("event") == "relaunched"), None)
            # A relaunch inside the allocation spends the budget; any other start is a new allocation.
            budget = max_restarts - int(relaunch.get("attempt") or 0) if relaunch else max_restarts
            prev_records = by_restart.get(before[0].get("restart"), [])
            info["steps_redone"] = max(0, last_step_of(before, prev_records) - info["resumed_from"])
            last_good = max((float(r["time"]) for r in prev_records), default=float(before[0]["time"]))
            first = min((float(r["time"]) for r in records), default=None)
            resumed = next((e for e in group if e.get("event") == "resumed"), None)
            if resumed is not None:
                first = min(first, float(resumed["time"])) if first is not None else float(resumed["time"])
            info["downtime_s"] = round(first - last_good, 3) if first is not None else None
        info["budget_left"] = budget
        out.append(info)
    return out


def describe(start: dict[str, Any]) -> str:
    """One line of dtk.status for a start."""
    nodes = ",".join(start.get("nodes") or [])
    line = (f"start {start.get('restart')}  job {start.get('job_id')} on {nodes} (world {start.get('world_size')})"
            f"  cause: {start['cause']}; from step {start['resumed_from']}")
    if start.get("tier") in ("memory", "peer"):  # a disk resume as before; --json has every start's tier
        line += f" ({start['tier']})"
    elif start.get("memory_fallback"):
        line += f" ({start.get('tier') or 'no checkpoint'}; memory tier not used: {start['memory_fallback']})"
    if "steps_redone" in start:
        down = f"{start['downtime_s']:.1f} s" if start.get("downtime_s") is not None else "not yet trained"
        line += f", {start['steps_redone']} steps redone, down {down}"
    return line + f"; relaunches left {start['budget_left']}"
