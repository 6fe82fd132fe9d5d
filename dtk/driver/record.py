"""What a driver writes when a start of the run ends badly, or when the run was stopped."""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

from dtk.common.rundir import WORKER_ERROR, RunDir, read_jsonl, read_progress, write_json_atomic
from dtk.common.storage import StoreUnreachable, checkpoints_of, latest_committed_step
from dtk.driver.decide import UserFault


def _own_progress(run: RunDir, events: list[dict[str, Any]]) -> int | None:
    """The progress file's step when the current (newest) start wrote it."""
    started = [e for e in events if e.get("event") == "started"]
    progress = read_progress(run)
    if progress is None or not started or progress[0] != started[-1].get("restart"):
        return None
    return progress[1]


def last_completed_step(run: RunDir) -> int:
    """The last optimizer step the current start completed, exact whatever train.log_every
    is (metrics.jsonl is written once per logging interval, so its newest record may lag by
    up to train.log_every - 1 steps). A start that completed no step yet: the step it began
    at (its `ready` or `checkpoint_loaded` event), else the newest record."""
    events = run.events_list()
    last_start = max((i for i, e in enumerate(events) if e.get("event") == "started"), default=-1)
    own = _own_progress(run, events)
    if own is not None:
        return own
    began = [e for e in events[last_start + 1:] if e.get("event") in ("ready", "checkpoint_loaded")]
    if last_start >= 0 and began and began[-1].get("step") is not None:
        return int(began[-1]["step"])
    done = run.latest_metrics()
    return max(done) if done else 0


def record_failure(run: RunDir, *, error: str, restarts: int, **details: Any) -> None:
    """A `failed` event and a failed summary: step and loss reached, and why it stopped.
    A later start that finishes overwrites the summary. A stop request the run did not get
    to is removed: the run has ended."""
    run.stop_request.unlink(missing_ok=True)
    run.event("failed", error=error, **details)
    done = run.latest_metrics()
    last = max(done) if done else 0
    write_json_atomic(
        run.summary,
        {
            "status": "failed",
            "final_step": max(last, last_completed_step(run)),
            "final_loss": done[last]["loss"] if done else None,
            "restarts": restarts,
            "error": error,
        },
    )


STORE_TRIES = 3
STORE_WAIT_S = 10.0
"""A checkpoint store that fails a listing is asked again this often, this far apart (s3fs
itself retries each request a few times first)."""


def latest_checkpoint_step(run: RunDir, *, tries: int = STORE_TRIES, wait_s: float = STORE_WAIT_S) -> int | None:
    """The newest checkpoint whose manifest is committed (what a resume starts from), where
    the run's checkpoint.dir puts them: RUN_DIR/checkpoints/ or an object store (read with
    the AWS_* variables the job inherited). One rule for every reader (dtk.common.storage).
    StoreUnreachable once `tries` listings of an object store failed; a local folder is
    listed once (its errors are not passing ones, and a driver stopping within Slurm's
    KillWait has no seconds to wait)."""
    for attempt in range(1, tries + 1):
        try:
            return latest_committed_step(checkpoints_of(run))
        except StoreUnreachable:
            if attempt == tries:
                raise
            time.sleep(wait_s)
    raise AssertionError("unreachable: the last try returns or raises")


def record_stopped(run: RunDir, *, by: str, restarts: int, **details: Any) -> int | None:
    """A `stopped` event and a stopped summary: the run ended because someone asked
    (dtk.stop, scancel, Ctrl-C), not because it failed; submitting the same command again
    resumes from `checkpoint`. Removes the stop request it acted on. Returns that step."""
    checkpoint = latest_checkpoint_step(run)
    # The step this start reached: the last record (an earlier start may have gone further).
    latest = next(iter(deque(read_jsonl(run.metrics), maxlen=1)), None)
    own = _own_progress(run, run.events_list())
    last = own if own is not None else int(latest["step"]) if latest else 0
    run.event("stopped", by=by, step=last, checkpoint=checkpoint, **details)
    write_json_atomic(
        run.summary,
        {
            "status": "stopped",
            "final_step": last,
            "final_loss": latest["loss"] if latest else None,
            "checkpoint": checkpoint,
            "restarts": restarts,
            "stopped_by": by,
        },
    )
    run.stop_request.unlink(missing_ok=True)
    return checkpoint


def read_user_fault(run: RunDir, start: int, *, step: int) -> UserFault | None:
    """What start `start` died of in user code: the lowest rank's record (dtk/worker/failure.py)
    that names a frame of the user's (a rank that died of a lost peer names none), with the
    run's last completed step `step`. None when no rank left such a record."""
    prefix, _, suffix = WORKER_ERROR.partition("{rank}")
    found: list[tuple[int, dict[str, Any]]] = []
    folder = run.log_dir(start)
    for path in folder.glob(f"{prefix}*{suffix}") if folder.is_dir() else ():
        number = path.name.removeprefix(prefix).removesuffix(suffix)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if number.isdigit() and isinstance(record, dict) and record.get("file"):
            found.append((int(number), record))
    if not found:
        return None
    rank, record = min(found, key=lambda f: f[0])
    return UserFault(type=str(record.get("type")), message=str(record.get("message")), file=str(record["file"]),
                     line=int(record.get("line") or 0), step=step, rank=rank)
