"""What a driver writes when a start of the run ends badly, or when the run was stopped."""

from __future__ import annotations

from collections import deque
from typing import Any

from dtk.rundir import RunDir, read_jsonl, write_json_atomic


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
            "final_step": last,
            "final_loss": done[last]["loss"] if done else None,
            "restarts": restarts,
            "error": error,
        },
    )


def latest_checkpoint_step(run: RunDir) -> int | None:
    """The newest checkpoint whose manifest is committed (what a resume starts from): the
    run directory's one rule (RunDir.latest_committed_step)."""
    return run.latest_committed_step()


def record_stopped(run: RunDir, *, by: str, restarts: int, **details: Any) -> int | None:
    """A `stopped` event and a stopped summary: the run ended because someone asked
    (dtk.stop, scancel, Ctrl-C), not because it failed; submitting the same command again
    resumes from `checkpoint`. Removes the stop request it acted on. Returns that step."""
    checkpoint = latest_checkpoint_step(run)
    # The step this start reached: the last record (an earlier start may have gone further).
    latest = next(iter(deque(read_jsonl(run.metrics), maxlen=1)), None)
    last = int(latest["step"]) if latest else 0
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
