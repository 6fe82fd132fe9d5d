"""What runs after every optimizer step, as named objects the trainer calls in a fixed,
visible order (`Trainer.fit`):

    metrics      the step's metrics.jsonl record, kept (rank 0)         dtk.train.metrics
    heartbeat    the file whose mtime tells the driver "alive" (rank 0) Heartbeat
    resumed      the `resumed` event, once, after a restart's first step ResumedEvent
    evaluation   validation loss every train.eval_every steps          dtk.train.evaluate
    checkpoint   a save every checkpoint.every steps or every_minutes  dtk.checkpoint.manager
    stop         a signal any rank received: agree, save, stop         AgreedStop
    profile      every train.log_every steps: gather phase times, flag  dtk.train.profile
                 stragglers, write the interval's metrics records

Each has `after_step(step, result)`, where `step` counts completed optimizer steps; the
profile also has `flush()`, which an agreed stop calls before it leaves the loop. A new
policy (a checkpoint-failure budget) is one more field of StepPolicies and one more line
in `Trainer.fit`, where its place in the order shows. Policies that are collective
(evaluation, checkpoint, stop, profile) run on every rank; the others do nothing on ranks
that do not write.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dtk.common.rundir import RunDir

if TYPE_CHECKING:  # both import this module
    from dtk.train.metrics import MetricsLog
    from dtk.train.profile import StepProfiler


class Policy(Protocol):
    def after_step(self, step: int, result: Any) -> Any: ...


@dataclass
class StepPolicies:
    """The policies of one run, by name; `Trainer.fit` runs them in its order."""

    metrics: MetricsLog  # also read outside the loop: closed, and its throughput figures
    heartbeat: Heartbeat
    resumed: Policy
    evaluation: Policy
    checkpoint: Policy
    stop: Policy
    profile: StepProfiler  # also flushed on an agreed stop, and its timer handed to the trainer


# A gap between two progress ticks longer than this many times the longest one measured in
# this start is a hang (HEARTBEAT_MARGIN x the measured gap, or fault.hang_timeout_s if longer).
HEARTBEAT_MARGIN = 2.0


class Heartbeat:
    """RUN_DIR/heartbeat, whose mtime tells the driver "alive" (global rank 0; `path` None
    elsewhere). A rank that stops (SIGSTOP, a collective that never completes) stops rank 0
    too at the next collective, so one file is enough for the driver to see a hang.

    What a beat proves: the training thread made progress. It counts (`tick`) after every
    micro-batch, every pipeline action (a stage's forward or backward of one micro-batch),
    every step and before every validation batch; a background thread (`start`) touches the
    file every `interval_s` while the count moved since its last beat, or while the training
    thread is inside a long operation it declared: the start up to the end of its first step
    (the checkpoint load, compilation, warm-up) and a checkpoint save or a wait on one
    (`busy`: the save's blocking part, and an optimizer step waiting for an async save's copy).

    The driver declares a hang after fault.hang_timeout_s without a beat. So that the limit
    is never shorter than honest work, the thread also beats for a while after the last
    tick: up to HEARTBEAT_MARGIN x the longest gap between two ticks measured in this start
    (the first gap, the start's own, excepted), less hang_timeout_s. A run whose ticks come
    faster than the timeout gets no such allowance, and a training thread blocked in a
    collective of a step is seen after fault.hang_timeout_s; a slower one is seen after
    twice its longest gap. A peer that stops during a declared operation is seen when the
    collective's own timeout (dist.timeout_s) ends it (docs/recovery.md)."""

    def __init__(
        self, path: Path | None, *, hang_timeout_s: float = 0.0, interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic, progress: Path | None = None, restart: int = 0,
    ) -> None:
        self.path = path
        self.hang_timeout_s = hang_timeout_s
        self.interval_s = interval_s
        self.clock = clock
        self.restart = restart
        self.last_step: int | None = None
        # RUN_DIR/progress: the last completed optimizer step of this start, for the driver's
        # account of lost work whatever train.log_every is. One fixed-width write in place
        # per step (no rename, no fsync): microseconds, and a SIGKILL of the process does
        # not lose what the kernel already has.
        self._progress_fd = os.open(progress, os.O_WRONLY | os.O_CREAT, 0o644) if progress is not None else None
        self.progress = 0  # written by the training thread only
        self.longest_gap_s = 0.0  # between two ticks outside declared operations (training thread)
        self._last_tick: float | None = None  # None: no gap is measured up to the next tick
        self._told_s = 0.0  # the raised limit last printed
        self._busy = 0
        self._first_step = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        if self.path is None:
            return
        try:
            os.utime(self.path)
        except FileNotFoundError:
            self.path.touch()

    def tick(self) -> None:
        """The training thread is alive (a micro-batch, a pipeline action, a step or a
        validation batch went by)."""
        now = self.clock()
        if self._last_tick is not None and not self._busy:
            self.longest_gap_s = max(self.longest_gap_s, now - self._last_tick)
            self._tell()
        self._last_tick = now
        self.progress += 1

    def allowance_s(self) -> float:
        """How long after the last tick the thread still beats: the part of the measured
        limit (HEARTBEAT_MARGIN x the longest gap) the driver's hang_timeout_s does not cover."""
        return max(0.0, HEARTBEAT_MARGIN * self.longest_gap_s - self.hang_timeout_s)

    def due(self, seen: int) -> bool:
        """Whether the thread beats now, `seen` being the count at its last beat."""
        if self.progress != seen or self._busy or self._first_step:
            return True
        return self._last_tick is not None and self.clock() - self._last_tick < self.allowance_s()

    def _tell(self) -> None:
        # Said in rank 0's log each time the raised limit grows by a quarter: an operator
        # reading a late hang verdict knows why it came late.
        limit = self.hang_timeout_s + self.allowance_s()
        if self.path is None or limit <= max(self.hang_timeout_s, 1.25 * self._told_s):
            return
        self._told_s = limit
        print(f"heartbeat: the longest gap between progress ticks is {self.longest_gap_s:.1f} s, longer than"
              f" fault.hang_timeout_s={self.hang_timeout_s:g} allows; a hang is declared after {limit:.0f} s"
              " without progress", flush=True)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """A long operation of the training thread (a checkpoint save or load): beat through it."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            self.progress += 1
            # The operation's time is no gap between ticks; nor is the rest of a start's
            # warm-up (the first micro-batch after a checkpoint load compiles).
            self._last_tick = None if self._first_step else self.clock()

    def start(self) -> None:
        """Beat now and from a background thread from now on; until the end of the first
        step (`after_step`) the start counts as busy."""
        self._first_step = True
        self._last_tick = None
        if self.path is None or self._thread is not None:
            return
        self.beat()
        self._thread = threading.Thread(target=self._run, name="dtk-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = self.progress
        while not self._stop.wait(self.interval_s):
            if self.due(seen):
                seen = self.progress
                self.beat()

    def record_step(self, step: int) -> None:
        """This start completed optimizer step `step` (read by dtk.common.rundir.read_progress)."""
        if step == self.last_step:
            return
        self.last_step = step
        if self._progress_fd is not None:
            os.pwrite(self._progress_fd, f"{self.restart:>10} {step:>12}\n".encode(), 0)

    def close(self) -> None:
        if self._progress_fd is not None:
            os.close(self._progress_fd)
            self._progress_fd = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def after_step(self, step: int, result: Any = None) -> None:
        self._first_step = False
        self.record_step(step)
        self.tick()
        if self._thread is None:  # before `start` (the first beat) or on a rank without a thread
            self.beat()
        # else the thread beats within interval_s of this tick: no file touched per step here


class ResumedEvent:
    """The `resumed` event (rank 0; `run` None elsewhere) after the first step completed by
    a restarted start: it closes the recovery the start belongs to, measured from the time
    the driver detected the fault (`recovery_from`, 0 when unknown)."""

    def __init__(
        self, run: RunDir | None, *, start_step: int, restart: int, world_size: int, recovery_from: float,
        job_id: str | None,
    ) -> None:
        self.run = run
        self.start_step = start_step
        self.details = {"restart": restart, "world_size": world_size, "job_id": job_id}
        self.recovery_from = recovery_from

    def after_step(self, step: int, result: Any = None) -> None:
        if self.run is None or not self.start_step or step != self.start_step + 1:
            return
        recovery_s = round(time.time() - self.recovery_from, 3) if self.recovery_from else None
        self.run.event("resumed", step=self.start_step, recovery_s=recovery_s, **self.details)


# How soon after a signal the ranks agree on it, as a share of the signal's lead time
# (fault.signal_lead_floor_s): 1.2 s of the default 60 s, leaving the rest for the save.
STOP_VOTE_SHARE = 0.02


class StopRequested(Exception):
    """Raised out of the loop once the agreed stop's checkpoint is committed, or known to
    have failed (`saved` False; `verified` is then the newest checkpoint that did commit)."""

    def __init__(self, step: int, signum: int, *, saved: bool = True, verified: int | None = None) -> None:
        how = "checkpoint committed" if saved else (
            f"its checkpoint could NOT be saved; the newest verified checkpoint is step {verified or 'none'}")
        super().__init__(f"stopped at step {step} on {signal.Signals(signum).name}; {how}")
        self.step = step
        self.signum = signum
        self.saved = saved


class AgreedStop:
    """Collective: when any rank received a stop signal (a time limit's USR2, a preemption's
    SIGTERM), every rank learns it at the same step boundary; they save that step together,
    wait for the save to commit, and stop (`StopRequested`). Not after the last step: the
    run is finishing anyway and its final save is already due.

    `agreed(seconds)` is the vote (dtk.worker.signals.StopFlag.vote, on a host group): it
    returns the signal any rank received (0 if none) and the largest seconds per step any
    rank measured. The ranks vote every `every` steps: after the first step, then as many
    steps as fit in `budget_s` at the agreed step time (a stop is seen within about
    `budget_s`, a small share of the signal's lead time), at least one. Every rank computes
    the same `every` from the same agreed numbers, so they always vote together."""

    def __init__(
        self, *, agreed: Callable[[float], tuple[int, float]], checkpoints: Any, total_steps: int, run: RunDir | None,
        restart: int, budget_s: float, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agreed = agreed
        self.checkpoints = checkpoints
        self.total_steps = total_steps
        self.run = run  # rank 0 writes the event
        self.restart = restart
        self.budget_s = budget_s
        self.clock = clock
        self.every = 1
        self.next_vote: int | None = None  # the step of the next vote; None: the first step
        self._since: tuple[int, float] | None = None  # (step, time) of the last vote

    def due(self, step: int) -> bool:
        return step < self.total_steps and (self.next_vote is None or step >= self.next_vote)

    def poll(self) -> bool:
        """Collective, outside the step boundary (before each validation batch): whether a
        stop is agreed now. If so, this step's `after_step` votes again and stops."""
        signum, _ = self.agreed(0.0)
        if signum:
            self.next_vote = 0
        return bool(signum)

    def after_step(self, step: int, result: Any = None) -> None:
        if not self.due(step):
            return
        now = self.clock()
        seconds = (now - self._since[1]) / (step - self._since[0]) if self._since else 0.0
        signum, step_s = self.agreed(seconds)
        self._since = (step, now)
        if step_s > 0:
            self.every = max(1, int(self.budget_s / step_s))
        self.next_vote = step + self.every
        if not signum:
            return
        self.checkpoints.save(step)  # a no-op when the step's save already started
        self.checkpoints.close()  # the stop is only safe once the save is committed
        verified = self.checkpoints.verified_step
        saved = verified == step  # a save that failed says so: the driver sees no new checkpoint
        if self.run is not None:
            self.run.event("preempted", step=step, signal=signal.Signals(signum).name, restart=self.restart,
                           saved=saved, checkpoint_step=verified)
        raise StopRequested(step, signum, saved=saved, verified=verified)
