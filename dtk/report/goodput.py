"""Job-lifetime goodput: where the wall time from the first submission to the end went.

A run that is preempted, crashes or loses a node spends time that trains nothing: waiting
in the queue, starting workers (interpreter and imports, process group, model build),
loading a checkpoint, and computing again the steps done after the last checkpoint.
Goodput is the share of the wall time that went into steps whose result was kept.

Everything here is derived from the run directory: the lifecycle events (each with its
`time`), the `ready` event rank 0 writes when a start begins its first step (with the
start-up parts it measured), and every metrics.jsonl record, including the earlier record
of a step that was redone. Pure: no torch, no I/O; the worker calls it for summary.json,
the report for its text and plot.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

PARTS = ("queue", "startup", "checkpoint_load", "redone", "productive", "checkpoint_save", "down", "other")
"""The parts of the wall time, in the order a job lives through them. `down`: no job of the
run queued or running (between a stopped or failed job and the next submission); `other`:
what is left (evaluation, teardown, failure detection, a step in flight when killed)."""

_QUEUE_STARTS = ("submitted", "requeued", "resubmitted")
_QUEUE_ENDS = ("stopped", "failed", "finished")  # a pending job cancelled (dtk.stop, scancel) ends its wait
_START_ENDS = ("failed", "stopped", "finished", "relaunched", "hang_detected", "node_failed", "preempted",
               *_QUEUE_STARTS)


def start_segments(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Events grouped by start: each group begins with a `started` event."""
    groups: list[list[dict[str, Any]]] = []
    for e in events:
        if e.get("event") == "started":
            groups.append([e])
        elif groups:
            groups[-1].append(e)
    return groups


# The events that end a start and name the step it reached (the driver's exact last step).
STEP_ENDINGS = ("relaunched", "node_failed", "requeued", "hang_detected", "preempted", "time_limit_near",
                "node_returned", "stopped", "failed", "finished")


def last_step_of(group: list[dict[str, Any]], records: Iterable[dict[str, Any]]) -> int:
    """The last step a start completed: the step its ending events name (the driver reads it
    from rank 0's progress file, exact) or its newest metrics record, whichever is later."""
    steps = [int(e["step"]) for e in group if e.get("event") in STEP_ENDINGS and e.get("step") is not None]
    return max(steps + [int(r["step"]) for r in records] + [0])


def resumed_from(group: list[dict[str, Any]]) -> int:
    """The checkpoint step a start loaded (0: it began from scratch). A divergence's rollback
    loads again inside the start: the start began from the load before it."""
    rolled = next((i for i, e in enumerate(group) if e.get("event") == "rolled_back"), len(group))
    loaded = [e for e in group[:rolled] if e.get("event") == "checkpoint_loaded"]
    return int(loaded[-1].get("step") or 0) if loaded else 0


def tier_of(group: list[dict[str, Any]]) -> str | None:
    """Where a start's state came from: "memory" (its node's snapshot store), "peer" (a replica
    on another node), "disk" (a checkpoint; also an event from before the memory tier); None:
    from scratch. `memory_fallback` says why a start with the tier on loaded from disk."""
    loaded = next((e for e in group if e.get("event") == "checkpoint_loaded"), None)
    return None if loaded is None else str(loaded.get("tier") or "disk")


def _lost(groups: list[list[dict[str, Any]]], metric_lines: list[dict[str, Any]], kept: list[dict[str, Any]],
          thrown: list[dict[str, Any]]) -> tuple[int, float]:
    """(steps redone, seconds they took the first time). A start's lost steps run from the
    checkpoint the next start loaded to its exact last step; those with a metrics record
    (written once per train.log_every) count their own time, the rest the start's median
    step time (the same step's time when it was done again, if the start has no record).
    Inside a start, a divergence's rollback redoes steps and a skipped update is a step of no
    use: their own records (dtk.train.divergence writes one every step)."""
    by_restart: dict[Any, list[dict[str, Any]]] = {}
    for r in metric_lines:
        by_restart.setdefault(r.get("restart"), []).append(r)
    thrown_at = {(r.get("restart"), int(r["step"])): float(r.get("step_time_s") or 0.0) for r in thrown}
    kept_at = {int(r["step"]): float(r.get("step_time_s") or 0.0) for r in kept}
    num_steps, seconds = 0, 0.0
    counted: set[tuple[Any, int]] = set()
    for group, after in zip(groups, groups[1:], strict=False):
        restart = group[0].get("restart")
        records = by_restart.get(restart, [])
        first, last = resumed_from(after), last_step_of(group, records)
        times = sorted(float(r.get("step_time_s") or 0.0) for r in records)
        median = times[len(times) // 2] if times else None
        for step in range(first + 1, last + 1):
            num_steps += 1
            counted.add((restart, step))
            if (restart, step) in thrown_at:
                seconds += thrown_at[(restart, step)]
            else:
                seconds += median if median is not None else kept_at.get(step, 0.0)
    for key, step_s in thrown_at.items():  # thrown inside a start: a rollback's first pass, a skipped update
        if key not in counted:
            num_steps += 1
            seconds += step_s
    return num_steps, seconds


def _step_seconds(records: Iterable[dict[str, Any]]) -> tuple[float, float]:
    """(training seconds, of which blocking checkpoint seconds) of these records."""
    total = ckpt = 0.0
    for r in records:
        total += float(r.get("step_time_s") or 0.0)
        ckpt += float((r.get("phases") or {}).get("checkpoint") or 0.0)
    return total, ckpt


def _one_start(group: list[dict[str, Any]], end: float, trained: set[Any]) -> dict[str, Any]:
    started = group[0]
    t0 = float(started["time"])
    ready = next((e for e in group if e.get("event") == "ready"), None)
    load = sum(float(e.get("seconds") or 0.0) for e in group if e.get("event") == "checkpoint_loaded")
    info: dict[str, Any] = {"restart": started.get("restart"), "job_id": started.get("job_id"), "time": t0,
                            "tier": tier_of(group)}
    if ready is not None:
        # The start-up ends where the first step begins; the checkpoint load inside it is its own part.
        info["startup_s"] = max(0.0, float(ready["time"]) - t0 - load)
        process_start = ready.get("process_start")
        if process_start:
            info["launch_s"] = max(0.0, float(process_start) - t0)
        for key in ("import_s", "process_group_s", "model_s"):
            if ready.get(key) is not None:
                info[key] = float(ready[key])
    elif started.get("restart") in trained:
        info["startup_s"] = 0.0  # trained, but wrote no `ready` event (a run from an older dtk): not measured
        info["startup_measured"] = False
    else:
        # Never reached its first step: start-up that trained nothing, up to the event that
        # ended it; a later submission or requeue in its group begins the down or queue time.
        ended = next((e for e in group[1:] if e.get("event") in _START_ENDS), None)
        last = float(ended["time"]) if ended is not None else float(group[-1]["time"]) if len(group) > 1 else end
        info["startup_s"] = max(0.0, min(last, end) - t0 - load)
        info["never_ready"] = True
    info["checkpoint_load_s"] = load
    return info


def account(events: list[dict[str, Any]], metric_lines: list[dict[str, Any]], *, end: float | None = None) -> dict[str, Any]:
    """The goodput account of a run. `end`: the moment it is taken (a finishing worker
    passes now); default, the last event or record."""
    events = sorted((e for e in events if "time" in e), key=lambda e: float(e["time"]))
    times = [float(e["time"]) for e in events] + [float(r["time"]) for r in metric_lines if "time" in r]
    if not times:
        return {"wall_s": 0.0, "parts": {f"{p}_s": 0.0 for p in PARTS}, "shares": {}, "goodput": None, "starts": []}
    submits = [float(e["time"]) for e in events if e.get("event") == "submitted"]
    first = min(submits) if submits else min(times)
    end = float(end) if end is not None else max(times)
    wall = max(end - first, 0.0)

    # Queue: from a submission or requeue to the start it led to; down: from the last sign of
    # life of a job that ended to the next submission.
    queue = down = 0.0
    pending: float | None = None
    last_alive = first
    metric_times = sorted(float(r["time"]) for r in metric_lines if "time" in r)
    for e in events:
        t = float(e["time"])
        kind = e.get("event")
        if kind == "submitted" and t > first:
            alive = max([last_alive] + [m for m in metric_times if m <= t])
            down += max(0.0, t - alive)
        if kind in _QUEUE_STARTS:
            pending = t if pending is None else pending
        elif kind == "started" and pending is not None:
            queue += max(0.0, t - pending)
            pending = None
        elif kind in _QUEUE_ENDS and pending is not None:  # cancelled while it waited: no start
            queue += max(0.0, t - pending)
            pending = None
        last_alive = t
    if pending is not None:  # still queued when the account is taken
        queue += max(0.0, end - pending)

    trained = {r.get("restart") for r in metric_lines}
    starts = [_one_start(g, end, trained) for g in start_segments(events)]
    startup = sum(s["startup_s"] for s in starts)
    load = sum(s["checkpoint_load_s"] for s in starts)

    # Redone: the earlier record of every step that was computed again after a restart or a
    # divergence's rollback, and a step whose update was skipped (dtk.train.divergence).
    last_index = {int(r["step"]): i for i, r in enumerate(metric_lines)}
    kept = [r for i, r in enumerate(metric_lines) if last_index[int(r["step"])] == i and not r.get("skipped")]
    thrown = [r for i, r in enumerate(metric_lines) if last_index[int(r["step"])] != i or r.get("skipped")]
    kept_s, kept_ckpt = _step_seconds(kept)
    num_redone, redone = _lost(start_segments(events), metric_lines, kept, thrown)
    if kept_ckpt or any("phases" in r for r in kept):
        save = kept_ckpt  # the profiled steps carry the blocking part of their saves
    else:
        save = sum(float(e.get("blocked_seconds") or 0.0) for e in events if e.get("event") == "checkpoint_saved")
    productive = kept_s - kept_ckpt
    parts = {
        "queue_s": queue, "startup_s": startup, "checkpoint_load_s": load, "redone_s": redone,
        "productive_s": productive, "checkpoint_save_s": save, "down_s": down,
    }
    parts["other_s"] = max(0.0, wall - sum(parts.values()))
    later = starts[1:]
    # What the restarts cost: every start after the first, its queue wait and the time down before it.
    restart_s = sum(s["startup_s"] + s["checkpoint_load_s"] for s in later) + down + queue - _first_queue(events)
    return {
        "wall_s": round(wall, 3),
        "first_submit": first,
        "end": end,
        "parts": {k: round(v, 3) for k, v in parts.items()},
        "shares": {k[:-2]: round(v / wall, 4) if wall else 0.0 for k, v in parts.items()},
        "goodput": round(productive / wall, 4) if wall else None,
        "restart_s": round(max(0.0, restart_s), 3),
        "redone_steps": num_redone,
        "skipped_updates": sum(1 for e in events if e.get("event") == "skipped_update"),
        "rollbacks": sum(1 for e in events if e.get("event") == "rolled_back"),
        "restarts": max(0, len(starts) - 1),
        "starts": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()} for s in starts],
    }


def _first_queue(events: list[dict[str, Any]]) -> float:
    """Queue wait before the first start: the part of the queue time that is not a restart's."""
    pending = None
    for e in events:
        if e.get("event") in _QUEUE_STARTS and pending is None:
            pending = float(e["time"])
        elif e.get("event") == "started" or (e.get("event") in _QUEUE_ENDS and pending is not None):
            return max(0.0, float(e["time"]) - pending) if pending is not None else 0.0
    return 0.0
