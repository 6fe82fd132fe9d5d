"""Divergence: a step whose loss or gradient norm is not finite, or whose loss spikes above
`fault.spike_factor` x the median of the last `fault.spike_window` good losses, is a bad
step. Its update is skipped (no optimizer or scheduler step, gradients zeroed: event
`skipped_update`). `fault.rollback_after` bad steps within `fault.rollback_window` steps
are a divergence: the run rolls back to the newest verified checkpoint before the first
bad step and skips the data window of the bad steps (event `rolled_back`), at most
`fault.max_rollbacks` times; the next one fails the run with one line (`Diverged`).

The check is on the globally reduced loss and gradient norm, so every rank reaches the
same verdict at the same step. It reads both on the host once per step: on a GPU that is
one wait per step (fault.divergence=false turns the check off).

The skipped data windows are the run's recorded sample order: RUN_DIR/data_skips.json,
read by every start (`data_step`), so a resume and a rerun read the same samples.

`python -m dtk.drill nan RUN_DIR` writes RUN_DIR/nan_request.json; rank 0 reads it at a
step boundary (`NanDrill`) and makes its loss of the requested steps NaN. No torch here:
the drill and the status read these files on a login node.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtk.common.rundir import write_json_atomic
from dtk.data.order import data_step  # noqa: F401  (the order the skips make: re-exported)

DATA_SKIPS = "data_skips.json"
NAN_REQUEST = "nan_request.json"
NAN_TAKEN = "nan_request.taken.json"

OK, SKIP, ROLLBACK, FAIL = "ok", "skip", "rollback", "fail"
# Good losses kept beyond the spike window, so that a rollback to a checkpoint up to this
# many steps back finds the window as it stood there (a few MB at most).
GOOD_HISTORY = 100_000


@dataclass
class BadStep:
    step: int  # completed-step count the update would have made
    cause: str  # nonfinite_loss, nonfinite_grad_norm, spike
    batch_hash: str
    loss: float


@dataclass
class Verdict:
    action: str  # OK, SKIP, ROLLBACK or FAIL
    bad: list[BadStep] = field(default_factory=list)  # the bad steps of a rollback or failure

    def cause(self) -> str:
        return self.bad[-1].cause if self.bad else ""


class Diverged(Exception):
    """The run diverged again after fault.max_rollbacks rollbacks (or had no checkpoint to
    roll back to): not a fault a relaunch cures. One line, the driver's to report."""


class Rollback(Exception):
    def __init__(self, bad: list[BadStep]) -> None:
        super().__init__(f"rollback before step {bad[0].step}")
        self.bad = bad


def bad_cause(loss: float, grad_norm: float, window: deque[float], *, spike_factor: float, spike_window: int) -> str:
    """Why a step is bad ("" when it is good). A spike needs a full window of good losses."""
    if not math.isfinite(loss):
        return "nonfinite_loss"
    if not math.isfinite(grad_norm):
        return "nonfinite_grad_norm"
    if spike_factor > 0 and len(window) >= spike_window:
        median = statistics.median(window)
        if median > 0 and loss > spike_factor * median:
            return "spike"
    return ""


class DivergenceWatch:
    """The pure decision, fed each step's global loss and gradient norm (every rank the same)."""

    def __init__(self, *, spike_factor: float, spike_window: int, rollback_after: int, rollback_window: int,
                 max_rollbacks: int, rollbacks_done: int = 0) -> None:
        self.spike_factor = spike_factor
        self.spike_window = max(1, spike_window)
        self.rollback_after = rollback_after
        self.rollback_window = rollback_window
        self.max_rollbacks = max_rollbacks
        self.rollbacks_done = rollbacks_done
        self.good: list[tuple[int, float]] = []  # (step, loss) of good steps, for the window after a rollback
        self.bad: list[BadStep] = []

    def _window(self) -> deque[float]:
        return deque((loss for _, loss in self.good[-self.spike_window:]), maxlen=self.spike_window)

    def observe(self, step: int, loss: float, grad_norm: float, batch_hash: str = "") -> Verdict:
        cause = bad_cause(loss, grad_norm, self._window(), spike_factor=self.spike_factor,
                          spike_window=self.spike_window)
        if not cause:
            self.good.append((step, loss))
            del self.good[:-(self.spike_window + GOOD_HISTORY)]
            return Verdict(OK)
        self.bad = [b for b in self.bad if b.step > step - self.rollback_window]
        self.bad.append(BadStep(step, cause, batch_hash, loss))
        if self.rollback_after < 1 or len(self.bad) < self.rollback_after:
            return Verdict(SKIP, [self.bad[-1]])
        bad, self.bad = self.bad, []
        if self.rollbacks_done >= self.max_rollbacks:
            return Verdict(FAIL, bad)
        self.rollbacks_done += 1
        return Verdict(ROLLBACK, bad)

    def restore(self, records: dict[int, dict[str, Any]], *, up_to: int) -> None:
        """After a resume from step `up_to`: the window and the bad steps as they stood then,
        from metrics.jsonl's latest record of each step (every step has one; a skipped one
        says why), so a resumed run judges its next steps as the uninterrupted one did."""
        steps = [s for s in sorted(records) if s <= up_to]
        self.good = [(s, float(records[s]["loss"])) for s in steps if not records[s].get("skipped")]
        del self.good[:-(self.spike_window + GOOD_HISTORY)]
        self.bad = [BadStep(s, records[s]["skipped"], records[s].get("batch_hash", ""), float(records[s]["loss"]))
                    for s in steps if records[s].get("skipped") and s > up_to - self.rollback_window]

    def rolled_back(self, to_step: int) -> None:
        """After the rollback to `to_step`: the window as it stood then (what this process saw)."""
        self.good = [(s, v) for s, v in self.good if s <= to_step]


def diverged_line(bad: list[BadStep], *, rollbacks: int, reason: str) -> str:
    steps = ", ".join(f"{b.step} ({b.cause}, batch {b.batch_hash})" for b in bad)
    return (f"the run diverged: bad steps {steps}; {reason} after {rollbacks} rollback(s)."
            " Not relaunched: lower the learning rate, check the data window, or raise fault.max_rollbacks")


# --- the recorded skips: the run's sample order -------------------------------------------

def read_skips(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / DATA_SKIPS
    return json.loads(path.read_text()) if path.is_file() else []


def record_skip(run_dir: Path, skip: dict[str, Any]) -> None:
    """Rank 0, before any rank resumes from the rollback's checkpoint."""
    write_json_atomic(Path(run_dir) / DATA_SKIPS, [*read_skips(run_dir), skip])


# --- the drill ----------------------------------------------------------------------------

def write_nan_request(run_dir: Path, *, at_step: int | None, num_steps: int) -> Path:
    path = Path(run_dir) / NAN_REQUEST
    write_json_atomic(path, {"at_step": at_step, "num_steps": num_steps})
    return path


class NanDrill:
    """Rank 0 (`run_dir` None elsewhere): at each step boundary, a pending request is taken
    (renamed, so a restart does not take it again): the next `num_steps` losses from step
    `at_step` on (None, or a step already past: the next step) become NaN. Counted, not
    keyed by step: the steps a rollback redoes are not poisoned again."""

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.first = 0
        self.left = 0

    def _take(self, step: int) -> None:
        assert self.run_dir is not None
        request = self.run_dir / NAN_REQUEST
        if not request.is_file():
            return
        try:
            wanted = json.loads(request.read_text())
        except (OSError, json.JSONDecodeError):  # half-written by hand: the next boundary
            return
        self.first = max(step, int(wanted.get("at_step") or step))
        self.left = int(wanted.get("num_steps", 1))
        write_json_atomic(self.run_dir / NAN_TAKEN, {**wanted, "steps": [self.first, self.first + self.left - 1]})
        request.unlink(missing_ok=True)

    def poisoned(self, step: int) -> bool:
        """Whether the loss of the step that completes `step` steps is made NaN."""
        if self.run_dir is not None:
            self._take(step)
        if self.left and step >= self.first:
            self.left -= 1
            return True
        return False


def as_json_number(value: float) -> float | str:
    """A loss for events.jsonl: strict JSON has no NaN, so a non-finite value is its name."""
    return value if math.isfinite(value) else str(value)
