"""What the Slurm driver does after each start of the workers: the decision table, pure.

The Supervisor gathers the facts of a start that ended (exit code, events, the nodes the
job still holds, the workers' logs) and carries out the action; everything between is
here, so every branch is a unit test (tests/test_supervisor.py).

    how the start ended          Kind           Action
    ---------------------------  -------------  ----------------------------------------------
    exit 0                       FINISHED       FINISH: the workers wrote summary.json
    a stop was asked for: a      STOP_ASKED     STOP: record `stopped` with the last committed
      request of dtk.stop, or                     checkpoint and end the job without a requeue
      scancel (Slurm shows the                    (the workers saved on the signal if they could)
      job CANCELLED)
    a worker exited 2 (a         CONFIG_ERROR   FAIL at once with the worker's `error:` line:
      configuration error)                        relaunching cannot fix a configuration
    exit 3, a `preempted` event, STOPPED        REQUEUE when a checkpoint was committed since
      or a signal to the driver                   the start; else FAIL (no progress: a requeue
                                                  would stop at the same place forever)
    a node left the job          NODE_FAILED    EXCLUDE the node(s) and start again: on the
                                                  spares, else on fewer nodes; not counted
                                                  against fault.max_restarts
    any other exit, the same     CRASHED        USER_CODE_ERROR: fail at once with the
      exception in user code as                   exception and the user's file:line (a bug in
      the previous start's (type,                 user code fails every start alike; starting
      message, file:line, step),                  again only spends fault.max_restarts)
      no checkpoint since
    any other exit               CRASHED        RELAUNCH from the last verified checkpoint,
    no heartbeat in time         HUNG             up to fault.max_restarts times per
                                                  allocation; then FAIL with the last cause

    before a start                              Action
    ------------------------------------------  ----------------------------------------------
    too few usable nodes for any plan           REQUEUE with the exclusions (no progress
      (fit_plan gives None)                       check: the allocation, not the run, failed)

The order of the first table is the order of `classify`: an asked-for stop wins over
everything but a finish (a stopped step may exit in any way), a configuration error over a
signalled stop, a signalled stop over a lost node, a lost node over a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from dtk.worker.codes import EXIT_CONFIG, EXIT_STOPPED


class Kind(str, Enum):
    FINISHED = "finished"
    STOP_ASKED = "stop_asked"
    CONFIG_ERROR = "config_error"
    STOPPED = "stopped"
    NODE_FAILED = "node_failed"
    CRASHED = "crashed"
    HUNG = "hung"


class Action(str, Enum):
    FINISH = "finish"
    STOP = "stop"
    FAIL = "fail"
    USER_CODE_ERROR = "user_code_error"
    REQUEUE = "requeue"
    EXCLUDE = "exclude"
    RELAUNCH = "relaunch"


@dataclass(frozen=True)
class Facts:
    """What the Supervisor saw when a worker step ended."""

    code: int | None
    """srun's exit code."""
    workers_stopped: bool = False
    """The workers wrote a `preempted` event during this start (they saved on a signal)."""
    signalled: bool = False
    """The driver itself received SIGTERM or USR2 during this start."""
    lost: tuple[str, ...] = ()
    """Nodes of this start that the job no longer holds."""
    error_line: str | None = None
    """A worker's `error:` line (a configuration error), with its rank."""
    crash_cause: str = ""
    """The first exception line in the ranks' logs, or how the step ended."""
    stop_asked: str = ""
    """Who asked the run to stop (`dtk.stop by alice`, `scancel`), or empty: a stop request
    file, or Slurm showing the job cancelled after the driver was signalled."""


@dataclass(frozen=True)
class UserFault:
    """What a crashed start's workers died of, from their records (dtk/worker/failure.py):
    the exception and the user's frame it came from, and the run's last completed step."""

    type: str
    message: str
    file: str
    line: int
    step: int
    rank: int = 0
    """The rank whose record it is (not compared: another rank may die first next time)."""

    def same_as(self, other: UserFault | None) -> bool:
        return other is not None and (self.type, self.message, self.file, self.line, self.step) == (
            other.type, other.message, other.file, other.line, other.step)

    def text(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.type}: {first} at {self.file}:{self.line} (step {self.step})"


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    code: int | None = None
    lost: tuple[str, ...] = field(default_factory=tuple)
    cause: str = ""
    detected_at: float = 0.0


def classify(facts: Facts, *, detected_at: float) -> Outcome:
    """How a worker step that exited ended (a hang is found while watching, not here)."""
    def outcome(kind: Kind, cause: str = "") -> Outcome:
        return Outcome(kind, facts.code, facts.lost, cause, detected_at)

    if facts.code == 0:
        return outcome(Kind.FINISHED)
    if facts.stop_asked:
        return outcome(Kind.STOP_ASKED, facts.stop_asked)
    if facts.error_line or facts.code == EXIT_CONFIG:
        return outcome(Kind.CONFIG_ERROR, facts.error_line or f"a worker exited with code {EXIT_CONFIG}"
                       " (a configuration error); see the ranks' logs")
    # Preemption signals srun too, so its exit code may say "terminated" although the
    # workers agreed, saved and stopped: their `preempted` event is what counts.
    if facts.code == EXIT_STOPPED or facts.workers_stopped or facts.signalled:
        return outcome(Kind.STOPPED, "stopped on a signal")
    if facts.lost:
        return outcome(Kind.NODE_FAILED, f"node(s) {','.join(facts.lost)} left the job")
    return outcome(Kind.CRASHED, facts.crash_cause)


@dataclass(frozen=True)
class Decision:
    action: Action
    error: str = ""
    """For FAIL: the one line the run's summary and the job log carry."""


def decide(outcome: Outcome, *, job_id: str, relaunches: int, max_restarts: int, progressed: bool,
           step: int, fault: UserFault | None = None, previous: UserFault | None = None) -> Decision:
    """The action after a start: `relaunches` is how many crash or hang relaunches this
    allocation made before it, `progressed` whether a checkpoint was committed since the
    start, `step` the last checkpoint's; `fault` what this start's workers died of in user
    code, `previous` what the start before it died of (None: not of an exception in user code)."""
    kind = outcome.kind
    if kind is Kind.FINISHED:
        return Decision(Action.FINISH)
    if kind is Kind.STOP_ASKED:
        return Decision(Action.STOP)
    if kind is Kind.CONFIG_ERROR:
        return Decision(Action.FAIL, f"configuration error in job {job_id}, not relaunched: {outcome.cause}")
    if kind is Kind.STOPPED:
        if progressed:
            return Decision(Action.REQUEUE)
        return Decision(Action.FAIL, f"job {job_id} stopped again at step {step} without completing a checkpoint"
                        " since its start; not requeued (is the time limit shorter than start-up plus a save?)")
    if kind is Kind.NODE_FAILED:
        return Decision(Action.EXCLUDE)
    if kind is Kind.CRASHED and fault is not None and fault.same_as(previous) and not progressed:
        return Decision(Action.USER_CODE_ERROR, f"the same exception in user code ended two starts in a row"
                        f" without progress; not relaunched (job {job_id}): {fault.text()}")
    if relaunches < max_restarts:
        return Decision(Action.RELAUNCH)
    return Decision(Action.FAIL, f"{kind.value} {relaunches + 1} times in job {job_id}"
                    f" (fault.max_restarts={max_restarts}); last cause: {outcome.cause}")
