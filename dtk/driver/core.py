"""What both drivers share: the liveness rule, the start-decide loop and the clock.

The local driver (dtk/driver/local.py, workers on this machine) and the Slurm supervisor
(dtk/driver/supervisor.py, a worker step in an allocation) are two backends of
`DriverCore`, as submitit's local and Slurm executors share one base. A backend says how
to start and watch the workers of one start (`start_workers`, returning an `Outcome`) and
how to carry out the actions it can reach; the loop, the decision and the bookkeeping
between starts are here, so both drivers decide alike and one fake clock tests either:

    before_start -> start_workers (watch until it ends) -> decide (dtk/driver/decide.py) -> on_ACTION

What to do after a start stays the table in dtk/driver/decide.py. A new case is a `Kind`
(the backends' `start_workers` report it; `decide` maps it) or an `Action`, which is also
a method `on_<action>` here or in the backend that can reach it
(tests/test_local_driver.py checks that every Action has one).

Every wait goes through `self.clock` (dtk.launch.slurmctl.Clock): the real one sleeps,
the tests' one moves forward at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtk.common.rundir import HEARTBEAT, USER_CODE_ERROR, RunDir, remove_memory_store
from dtk.config.schema import FaultConfig
from dtk.driver.decide import Decision, Kind, Outcome, UserFault, decide
from dtk.driver.record import last_completed_step, latest_checkpoint_step, read_user_fault
from dtk.launch.slurmctl import Clock
from dtk.plan.plan import Plan


@dataclass(frozen=True)
class Silence:
    """How long the workers of a start have been silent, against the limit that applies."""

    silent_s: float
    limit_s: float

    @property
    def hung(self) -> bool:
        return self.silent_s > self.limit_s

    def cause(self) -> str:
        return f"no heartbeat for {self.silent_s:.0f} s (limit {self.limit_s} s)"


def silence(*, beat: float, started: float, now: float, fault: FaultConfig) -> Silence:
    """The liveness rule. Before this start's first heartbeat (`beat` older than `started`,
    or 0.0 for none), `fault.startup_timeout_s` counts from the start: building the model,
    the first collective and a checkpoint load take longer than a step. After it,
    `fault.hang_timeout_s` counts from the latest beat."""
    if beat < started:
        return Silence(now - started, fault.startup_timeout_s)
    return Silence(now - beat, fault.hang_timeout_s)


def heartbeat_time(run: RunDir) -> float:
    """When rank 0 last beat (the heartbeat file's mtime); 0.0 before its first beat."""
    try:
        return (run.path / HEARTBEAT).stat().st_mtime
    except FileNotFoundError:
        return 0.0


class DriverCore:
    """One run's driver: start the workers, see how the start ended, decide, act, until an
    action ends the run with an exit code."""

    def __init__(self, run: RunDir, plan: Plan, job_id: str, *, clock: Clock) -> None:
        self.run = run
        self.plan = plan
        self.job_id = job_id
        self.clock = clock
        self.fault = plan.config.fault
        self.relaunches = 0  # after crashes and hangs, in this allocation (the local run is one)
        self.recovery_from = 0.0  # when the fault the next start recovers from was detected; 0.0: none
        self.died_of: UserFault | None = None  # what the latest start died of in user code; None: not that

    # --- the backend's part ----------------------------------------------------------------
    def before_start(self) -> int | None:
        """Checks before each start; an exit code ends the run without starting."""
        return None

    def start_workers(self, recovery_from: float) -> Outcome:
        """Start the workers, watch them until the start ends, and say how it ended."""
        raise NotImplementedError

    def relaunch_details(self) -> dict:
        """What the `relaunched` event says about the failure besides its cause."""
        return {}

    # --- the loop -------------------------------------------------------------------------
    def drive(self) -> int:
        """Start, watch and decide until an action returns the run's exit code. However it ends,
        the allocation's end takes this node's part of the memory tier's store with it (the
        workers remove theirs at a finish or stop; a new run's first start clears stale ones)."""
        try:
            return self._drive()
        finally:
            remove_memory_store(self.run.path)

    def _drive(self) -> int:
        self.recovery_from = self.recovery_from_previous_job()
        while True:
            early = self.before_start()
            if early is not None:
                return early
            step_at_start = self.checkpoint_step()
            outcome = self.start_workers(self.recovery_from)
            step = self.checkpoint_step()
            previous, self.died_of = self.died_of, self.user_fault(outcome)
            decision = decide(outcome, job_id=self.job_id, relaunches=self.relaunches,
                              max_restarts=self.fault.max_restarts, progressed=step > step_at_start, step=step,
                              fault=self.died_of, previous=previous)
            code = self.act(decision, outcome, step)
            if code is not None:
                return code
            self.recovery_from = outcome.detected_at

    def act(self, decision: Decision, outcome: Outcome, step: int) -> int | None:
        """Carry out a decision: the run's exit code, or None to start again."""
        return getattr(self, f"on_{decision.action.value}")(decision, outcome, step)

    # --- the actions (a backend overrides those it carries out its own way) -----------------
    def on_finish(self, decision: Decision, outcome: Outcome, step: int) -> int | None:
        self.run.stop_request.unlink(missing_ok=True)  # the run ended before a stop took effect
        return 0

    def on_relaunch(self, decision: Decision, outcome: Outcome, step: int) -> int | None:
        self.relaunches += 1
        self.run.event("relaunched", job_id=self.job_id, cause=outcome.kind.value, detail=outcome.cause,
                       step=self.last_step(), **self.resume_fields(step), attempt=self.relaunches,
                       **self.relaunch_details())
        return None

    def resume_fields(self, step: int) -> dict:
        """What a recovery event says the next start resumes from. The disk checkpoint
        `step`, as `resume_from`, unless the in-memory tier is on (checkpoint.memory_every):
        then the workers choose at the start (the newest snapshot not older than the disk,
        else the disk), the driver cannot know which, and `resume_from` is null beside
        `disk_checkpoint`; the next start's `checkpoint_loaded` event says the step, as
        dtk.status does."""
        if self.plan.config.checkpoint.memory_every:
            return {"resume_from": None, "disk_checkpoint": step}
        return {"resume_from": step}

    def on_user_code_error(self, decision: Decision, outcome: Outcome, step: int) -> int | None:
        """The same exception in user code ended this start and the one before: a
        `user_code_error` event, then the run fails as the backend fails it."""
        self.record_user_code_error()
        return self.on_fail(decision, outcome, step)

    def record_user_code_error(self) -> None:
        fault = self.died_of
        assert fault is not None, "decide chooses USER_CODE_ERROR only with a fault"
        self.run.event(USER_CODE_ERROR, job_id=self.job_id, type=fault.type, message=fault.message, file=fault.file,
                       line=fault.line, step=fault.step, rank=fault.rank)

    def on_stop(self, decision: Decision, outcome: Outcome, step: int) -> int | None:
        raise NotImplementedError

    def on_fail(self, decision: Decision, outcome: Outcome, step: int) -> int | None:
        raise NotImplementedError

    def on_requeue(self, decision: Decision, outcome: Outcome, step: int) -> int | None:
        raise AssertionError(f"{type(self).__name__} cannot requeue ({outcome.kind.value}: {outcome.cause})")

    def on_exclude(self, decision: Decision, outcome: Outcome, step: int) -> int | None:
        raise AssertionError(f"{type(self).__name__} cannot exclude nodes ({outcome.kind.value}: {outcome.cause})")

    # --- shared facts ------------------------------------------------------------------------
    def silence(self, started: float) -> Silence:
        """The liveness rule applied to this run's heartbeat now (see `silence`)."""
        return silence(beat=heartbeat_time(self.run), started=started, now=self.clock.time(), fault=self.fault)

    def hang_detected(self, found: Silence, nodes: list[str]) -> Outcome:
        """Record a hang (the caller then tears the start down) and say how the start ended."""
        self.run.event("hang_detected", job_id=self.job_id, nodes=nodes, step=self.last_step(),
                       silent_s=round(found.silent_s, 1), limit_s=found.limit_s)
        return Outcome(Kind.HUNG, cause=found.cause(), detected_at=self.clock.time())

    def checkpoint_step(self) -> int:
        """The newest committed checkpoint's step (0 for none): what a relaunch resumes from."""
        return latest_checkpoint_step(self.run) or 0

    def last_step(self) -> int:
        """The last step the current start completed (rank 0's progress file, exact)."""
        return last_completed_step(self.run)

    def user_fault(self, outcome: Outcome) -> UserFault | None:
        """What the start that just ended died of in user code (its workers' records); None
        for any end but a crash."""
        if outcome.kind is not Kind.CRASHED:
            return None
        return read_user_fault(self.run, self.run.starts() - 1, step=self.last_step())

    def restarts(self) -> int:
        return max(0, self.run.starts() - 1)

    def recovery_from_previous_job(self) -> float:
        """When the fault the first start recovers from was detected; 0.0: not a recovery."""
        return 0.0
