"""What a driver writes when a start of the run ends badly."""

from __future__ import annotations

from typing import Any

from dtk.rundir import RunDir, write_json_atomic


def record_failure(run: RunDir, *, error: str, restarts: int, **details: Any) -> None:
    """A `failed` event and a failed summary: step and loss reached, and why it stopped.
    A later start that finishes overwrites the summary."""
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
