"""The driver on the local cluster: start the workers on this machine, watch them, and
relaunch them after a crash or a hang, as the Slurm driver does in an allocation.

The same decision table as on Slurm (dtk/driver/decide.py) with the same limits
(`fault.max_restarts` relaunches after crashes and hangs, `fault.hang_timeout_s` without a
heartbeat, `fault.startup_timeout_s` before the first) and the same events (`started`,
`hang_detected`, `relaunched`, `resumed`, `failed`, `stopped`). There is no requeue here:
a stop (Ctrl-C, SIGTERM to the driver, `python -m dtk.stop`) ends the run, and running the
same command again resumes it.

No torch here: the driver only starts, watches and stops processes and reads the run
directory. Workers run in their own session so a Ctrl-C in the terminal reaches the
driver alone, which then stops them in order.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dtk.driver.decide import Action, Kind, Outcome, decide
from dtk.driver.logs import error_line, last_line
from dtk.driver.record import last_completed_step, latest_checkpoint_step, record_failure, record_stopped
from dtk.plan.plan import Plan
from dtk.rundir import HEARTBEAT, RunDir, process_identity
from dtk.worker.codes import EXIT_CONFIG, EXIT_STOPPED
from dtk.worker.env import driver_env, rank_env

POLL_S = 0.2
STOP_GRACE_S = 60.0  # SIGTERM -> the workers agree, save and exit; then SIGKILL


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(*, rank: int, world: int, local_world: int, port: int, restart: int, plan: Path,
               recovery_from: float | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        rank_env(rank=rank, local_rank=rank % local_world, world_size=world, local_world_size=local_world,
                 node_rank=rank // local_world),
        # The same variables the Slurm supervisor sets; a relaunch recovers from the fault's detection.
        **driver_env(master_addr="127.0.0.1", master_port=port, restart=restart, plan=plan,
                     recovery_from=recovery_from),
        PYTHONUNBUFFERED="1",
    )
    return env


def tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(text[-lines:])


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the driver dies, even by SIGKILL, so no
    orphaned workers go on writing into a run that a new driver may start again. Linux only;
    elsewhere the workers outlive a killed driver."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


PR_SET_PDEATHSIG = 1


class _Terminated(Exception):
    pass


def _raise_terminated(signum, _frame) -> None:
    raise _Terminated(signal.Signals(signum).name)


class LocalDriver:
    def __init__(self, plan: Plan, run: RunDir, *, progress=None, lock_fd: int | None = None) -> None:
        self.plan = plan
        # The run lock's descriptor, inherited by every worker: the flock lives until the last
        # holder exits, so a killed dtk.submit does not free the run while its workers save.
        self.lock_fds = () if lock_fd is None else (lock_fd,)
        self.run = run
        self.progress = progress
        self.fault = plan.config.fault
        self.job_id = f"local-{os.getpid()}"
        self.procs: list[subprocess.Popen] = []
        self.stop_signalled = False
        self.failure: dict = {}  # the failed rank of the latest start: rank, host, exit code, log, last line

    def start(self, recovery_from: float | None = None) -> Path:
        restart = self.run.starts()
        logs = self.run.log_dir(restart)
        logs.mkdir(parents=True, exist_ok=True)
        port = free_port()
        world = self.plan.world_size
        self.run.event(
            "started",
            restart=restart,
            job_id=self.job_id,
            nodes=[socket.gethostname()],
            world_size=world,
            **process_identity(),  # pid, start time and name: a reused pid is not this driver
        )
        self.procs = []
        for rank in range(world):
            log = open(logs / f"rank_{rank}.log", "ab")
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "dtk.worker", str(self.run.path)],
                    env=worker_env(rank=rank, world=world, local_world=world, port=port, restart=restart,
                                   plan=self.run.plan_json, recovery_from=recovery_from),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                    pass_fds=self.lock_fds,
                )
            )
            log.close()
        pids = [p.pid for p in self.procs]
        (logs / "pids").write_text("\n".join(map(str, pids)) + "\n")
        return logs

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (the workers agree, save and exit; SIGKILL after STOP_GRACE_S), or SIGKILL
        at once: after a crash or a hang the others cannot save (a save is collective)."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in alive:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def watch(self, logs: Path) -> Outcome:
        """Wait for the workers of one start: how it ended (the Slurm driver's Kinds)."""
        started = time.time()
        heartbeat = self.run.path / HEARTBEAT
        while True:
            codes = [p.poll() for p in self.procs]
            if self.progress is not None:
                self.progress.poll()
            request = self.run.read_stop_request()
            if request is not None and not self.stop_signalled:
                self.stop_signalled = True
                self.stop(kill=bool(request.get("now")))
                return Outcome(Kind.STOP_ASKED, cause=stop_request_text(request), detected_at=time.time())
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0, EXIT_STOPPED)]
            if failed:
                # A configuration error explains the others' fate (their peer left); else the
                # first seen to die is the cause, the others' errors its consequences.
                rank, code = min(failed, key=lambda f: f[1] != EXIT_CONFIG)
                self.stop(kill=True)
                return self._crashed(rank, code, logs)
            if all(c in (0, EXIT_STOPPED) for c in codes):
                if self.progress is not None:
                    self.progress.poll(final=True)
                if EXIT_STOPPED in codes:
                    return Outcome(Kind.STOP_ASKED, cause="a signal to the workers", detected_at=time.time())
                return Outcome(Kind.FINISHED, code=0)
            try:
                beat = heartbeat.stat().st_mtime
            except FileNotFoundError:
                beat = 0.0
            now = time.time()
            if beat < started:
                silent, limit = now - started, self.fault.startup_timeout_s
            else:
                silent, limit = now - beat, self.fault.hang_timeout_s
            if silent > limit:
                self.run.event("hang_detected", job_id=self.job_id, nodes=[socket.gethostname()],
                               step=self._last_step(), silent_s=round(silent, 1), limit_s=limit)
                self.stop(kill=True)
                return Outcome(Kind.HUNG, cause=f"no heartbeat for {silent:.0f} s (limit {limit} s)", detected_at=now)
            time.sleep(POLL_S)

    def _crashed(self, rank: int, code: int, logs: Path) -> Outcome:
        log = logs / f"rank_{rank}.log"
        self.failure = {"rank": rank, "host": socket.gethostname(), "exit_code": code, "log": str(log),
                        "last_line": last_line(log)}
        said = error_line(log) if code == EXIT_CONFIG else None
        if said:  # the worker's own error line says it all; starting again cannot fix it
            return Outcome(Kind.CONFIG_ERROR, code=code, cause=f"rank {rank}: {said}", detected_at=time.time())
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return Outcome(Kind.CRASHED, code=code, cause=f"worker rank {rank} on {socket.gethostname()} {how}",
                       detected_at=time.time())

    def _last_step(self) -> int:
        return last_completed_step(self.run)

    def _restarts(self) -> int:
        return max(0, self.run.starts() - 1)

    def run_to_end(self) -> int:
        previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            return self._loop()
        except (KeyboardInterrupt, _Terminated) as exc:
            why = str(exc) or "SIGINT"
            print(f"\n{why}: the workers save at the end of this step and stop", file=sys.stderr)
            self.stop()
            checkpoint = record_stopped(self.run, by=why, restarts=self._restarts(), job_id=self.job_id)
            print(f"stopped; {_resume_text(checkpoint)}", file=sys.stderr)
            return 130
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        relaunches, recovery_from = 0, None
        while True:
            self.failure = {}
            step_at_start = latest_checkpoint_step(self.run) or 0
            outcome = self.watch(self.start(recovery_from))
            step = latest_checkpoint_step(self.run) or 0
            decision = decide(outcome, job_id=self.job_id, relaunches=relaunches,
                              max_restarts=self.fault.max_restarts, progressed=step > step_at_start, step=step)
            if decision.action is Action.FINISH:
                self.run.stop_request.unlink(missing_ok=True)  # the run ended before a stop took effect
                return 0
            if decision.action is Action.STOP:
                checkpoint = record_stopped(self.run, by=outcome.cause, restarts=self._restarts(), job_id=self.job_id)
                print(stopped_line(outcome.cause, checkpoint))
                return EXIT_STOPPED
            if decision.action is Action.FAIL:
                return self._fail(outcome, decision.error)
            assert decision.action is Action.RELAUNCH, decision
            relaunches += 1
            recovery_from = outcome.detected_at
            self.run.event("relaunched", job_id=self.job_id, cause=outcome.kind.value, detail=outcome.cause,
                           step=self._last_step(), resume_from=step, attempt=relaunches, **self.failure)
            print(f"relaunching ({outcome.kind.value}: {outcome.cause}); from checkpoint step {step},"
                  f" {self.fault.max_restarts - relaunches} relaunch(es) left", file=sys.stderr)

    def _fail(self, outcome: Outcome, error: str) -> int:
        log = self.failure.get("log")
        if outcome.kind is Kind.CONFIG_ERROR:  # the worker's own line, as it would say it
            error = outcome.cause.split(": ", 1)[1].removeprefix("error: ")
            record_failure(self.run, error=error, restarts=self._restarts(), **self.failure)
            print(f"error: {error} (worker rank {self.failure['rank']}; log {log})", file=sys.stderr)
            return EXIT_CONFIG
        record_failure(self.run, error=error, restarts=self._restarts(), **self.failure)
        excerpt = tail(Path(log)) if log else ""
        if excerpt:
            print(f"--- last lines of {log}\n{excerpt}\n---", file=sys.stderr)
        print(f"error: {error}. Log: {log or self.run.log_dir(self.run.starts() - 1)}."
              " Running the same command again resumes from the latest checkpoint.", file=sys.stderr)
        return 1


def stop_request_text(request: dict) -> str:
    """`dtk.stop by alice` (`--now` added when the workers were not to save)."""
    return f"dtk.stop by {request.get('by', '?')}" + (" --now" if request.get("now") else "")


def stopped_line(cause: str, checkpoint: int | None) -> str:
    """What the local driver prints when a stop ended the run: --now killed the workers
    before any save, so it resumes from an older checkpoint."""
    how = "the workers killed without saving" if cause.endswith(" --now") else "after committing a checkpoint"
    return f"stopped ({cause}) {how}; {_resume_text(checkpoint)}"


def _resume_text(checkpoint: int | None) -> str:
    if checkpoint is None:
        return "no checkpoint yet: the same command starts the run from the beginning"
    return f"run the same command to continue from checkpoint step {checkpoint}"
