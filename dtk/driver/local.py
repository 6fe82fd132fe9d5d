"""The driver on the local cluster: start the workers on this machine, watch them, and
relaunch them after a crash or a hang, as the Slurm driver does in an allocation.

The local backend of the driver core both drivers share (dtk/driver/core.py): the same
decision table as on Slurm (dtk/driver/decide.py) with the same limits
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtk.common.processes import process_identity
from dtk.common.rundir import FORKSERVER_LOG, LOGS_DIR, RunDir
from dtk.driver.core import DriverCore
from dtk.driver.decide import Decision, Kind, Outcome
from dtk.driver.forkserver import ForkServer, ForkServerFailed
from dtk.driver.logs import error_line, last_line
from dtk.driver.record import record_failure, record_stopped
from dtk.launch.slurmctl import Clock
from dtk.plan.plan import Plan
from dtk.worker.codes import EXIT_CONFIG, EXIT_STOPPED
from dtk.worker.env import driver_env, rank_env
from dtk.worker.forkserver import die_with_parent

POLL_S = 0.2
STOP_GRACE_S = 60.0  # SIGTERM -> the workers agree, save and exit; then SIGKILL


def free_port() -> int:
    """A port for the rendezvous (rank 0's TCPStore), free now and below the kernel's range of
    ephemeral ports: every connection another process opens (gloo's many among them) takes an
    ephemeral port, so one picked there (bind to port 0) can be taken in the seconds before
    rank 0 binds it, and the start fails with EADDRINUSE. Below the range only explicit
    binds compete."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default start of the range
    choose = random.SystemRandom()
    for _ in range(100):
        port = choose.randint(20000, low - 1) if low > 21000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port for the rendezvous")


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


class _Terminated(Exception):
    pass


def _raise_terminated(signum, _frame) -> None:
    raise _Terminated(signal.Signals(signum).name)


def spawn_worker(argv: list[str], *, env: dict[str, str], log: Path, pass_fds: tuple[int, ...] = ()
                 ) -> subprocess.Popen:
    """One worker process, its output appended to `log`, in a session of its own; `pass_fds`
    are inherited (the run lock's descriptor)."""
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent, pass_fds=pass_fds)


class LocalDriver(DriverCore):
    """The local backend of DriverCore. `clock` and `spawn` (how one worker process starts,
    `spawn_worker`'s signature) are what tests replace to play its decisions in fake time.

    By default the workers are forked by a fork server (dtk.worker.forkserver) that imported
    torch and the training stack once for the run: a start of N workers, and each relaunch,
    skip N interpreters' imports. Where the server cannot start, each worker is a process of
    its own (`spawn_worker`), as `spawn=spawn_worker` asks."""

    def __init__(self, plan: Plan, run: RunDir, *, progress=None, clock: Clock | None = None,
                 spawn: Callable[..., Any] | None = None, lock_fd: int | None = None) -> None:
        super().__init__(run, plan, f"local-{os.getpid()}", clock=clock or Clock())
        self.progress = progress
        # The run lock's descriptor, inherited by every worker: the flock lives until the last
        # holder exits, so a killed dtk.submit does not free the run while its workers save.
        self.lock_fds = () if lock_fd is None else (lock_fd,)
        self.spawn = spawn
        self.server: ForkServer | None = None
        self.procs: list[Any] = []  # Popen, or the fork server's ForkedWorker
        self.stop_signalled = False
        self.failure: dict = {}  # the failed rank of the latest start: rank, host, exit code, log, last line
        self.announce_resume = False  # say where the relaunched start resumed once it loaded (the memory tier)

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
        spawn = self._spawner()
        self.procs = [
            spawn([sys.executable, "-m", "dtk.worker", str(self.run.path)],
                       env=worker_env(rank=rank, world=world, local_world=world, port=port, restart=restart,
                                      plan=self.run.plan_json, recovery_from=recovery_from),
                       log=logs / f"rank_{rank}.log", **({"pass_fds": self.lock_fds} if self.lock_fds else {}))
            for rank in range(world)
        ]
        pids = [p.pid for p in self.procs]
        (logs / "pids").write_text("\n".join(map(str, pids)) + "\n")
        return logs

    def _spawner(self) -> Callable[..., Any]:
        """How this start's workers start: the tests' `spawn`, else the run's fork server
        (started at the first start, kept for relaunches), else a process each."""
        if self.spawn is not None:
            return self.spawn
        if self.server is None or not self.server.alive:
            try:
                self.server = ForkServer(env=dict(os.environ), log=self.run.path / LOGS_DIR / FORKSERVER_LOG,
                                         pass_fds=self.lock_fds, preexec_fn=die_with_parent)
            except ForkServerFailed as exc:
                print(f"note: {exc}; starting each worker as a process of its own", file=sys.stderr)
                self.spawn = spawn_worker
                return spawn_worker
        server = self.server

        def forked(argv: list[str], *, env: dict[str, str], log: Path, **_fds: Any) -> Any:
            try:
                return server.spawn(argv, env=env, log=log)
            except ForkServerFailed as exc:
                print(f"note: {exc}; starting the worker as a process of its own", file=sys.stderr)
                return spawn_worker(argv, env=env, log=log, pass_fds=self.lock_fds)

        return forked

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (the workers agree, save and exit; SIGKILL after STOP_GRACE_S), or SIGKILL
        at once: after a crash or a hang the others cannot save (a save is collective)."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        deadline = self.clock.monotonic() + STOP_GRACE_S
        for p in alive:
            try:
                p.wait(timeout=max(0.1, deadline - self.clock.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def start_workers(self, recovery_from: float) -> Outcome:
        self.failure = {}
        return self.watch(self.start(recovery_from))

    def watch(self, logs: Path) -> Outcome:
        """Wait for the workers of one start: how it ended (the Slurm driver's Kinds)."""
        started = self.clock.time()
        while True:
            codes = [p.poll() for p in self.procs]
            if self.progress is not None:
                self.progress.poll()
            if self.announce_resume:
                self._announce_resumed()
            request = self.run.read_stop_request()
            if request is not None and not self.stop_signalled:
                self.stop_signalled = True
                self.stop(kill=bool(request.get("now")))
                return Outcome(Kind.STOP_ASKED, cause=stop_request_text(request), detected_at=self.clock.time())
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0, EXIT_STOPPED)]
            if failed:
                # A configuration error explains the others' fate (their peer left); else the
                # first to die is the cause, the others' errors its consequences (when the
                # workers' parent told when each ended). Among ends seen at once, a death by
                # a signal (SIGKILL, SIGSEGV) comes first: a peer's death ends a worker with
                # an exception, not a signal. Then the lowest rank.
                rank, code = min(failed, key=lambda f: (f[1] != EXIT_CONFIG, self._ended_at(f[0]), f[1] >= 0))
                self.stop(kill=True)
                return self._crashed(rank, code, logs)
            if all(c in (0, EXIT_STOPPED) for c in codes):
                if self.progress is not None:
                    self.progress.poll(final=True)
                if EXIT_STOPPED in codes:
                    return Outcome(Kind.STOP_ASKED, cause="a signal to the workers", detected_at=self.clock.time())
                return Outcome(Kind.FINISHED, code=0)
            found = self.silence(started)
            if found.hung:
                outcome = self.hang_detected(found, [socket.gethostname()])
                self.stop(kill=True)
                return outcome
            self.clock.sleep(POLL_S)

    def _ended_at(self, rank: int) -> float:
        return getattr(self.procs[rank], "ended_at", None) or 0.0

    def _crashed(self, rank: int, code: int, logs: Path) -> Outcome:
        log = logs / f"rank_{rank}.log"
        self.failure = {"rank": rank, "host": socket.gethostname(), "exit_code": code, "log": str(log),
                        "last_line": last_line(log)}
        if code == EXIT_CONFIG:  # a configuration error: starting again cannot fix it
            said = error_line(log) or f"error: a worker exited with code {EXIT_CONFIG} (a configuration error); see {log}"
            return Outcome(Kind.CONFIG_ERROR, code=code, cause=f"rank {rank}: {said}", detected_at=self.clock.time())
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return Outcome(Kind.CRASHED, code=code, cause=f"worker rank {rank} on {socket.gethostname()} {how}",
                       detected_at=self.clock.time())

    def run_to_end(self) -> int:
        previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            return self.drive()
        except (KeyboardInterrupt, _Terminated) as exc:
            why = str(exc) or "SIGINT"
            print(f"\n{why}: the workers save at the end of this step and stop", file=sys.stderr)
            self.stop()
            checkpoint = record_stopped(self.run, by=why, restarts=self.restarts(), job_id=self.job_id)
            print(f"stopped; {_resume_text(checkpoint)}", file=sys.stderr)
            return 130
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.server is not None:
                self.server.close()

    # --- the actions of dtk/driver/decide.py this backend reaches ---------------------------
    def relaunch_details(self) -> dict:
        return self.failure

    def on_relaunch(self, decision: Decision, outcome: Outcome, step: int) -> int | None:
        super().on_relaunch(decision, outcome, step)
        # With the in-memory tier the workers choose the step (resume_fields): said once they loaded.
        self.announce_resume = bool(self.plan.config.checkpoint.memory_every)
        source = (f"from the newest in-memory snapshot, else checkpoint step {step} on disk" if self.announce_resume
                  else f"from checkpoint step {step}")
        print(f"relaunching ({outcome.kind.value}: {outcome.cause}); {source},"
              f" {self.fault.max_restarts - self.relaunches} relaunch(es) left", file=sys.stderr)
        return None

    def _announce_resumed(self) -> None:
        """Once the relaunched workers are ready: the step they resumed from and where it came
        from, read from their `ready` and `checkpoint_loaded` events, as dtk.status reads them."""
        events = self.run.events_list()
        last_start = max((i for i, e in enumerate(events) if e.get("event") == "started"), default=-1)
        since = events[last_start + 1:]
        ready = next((e for e in since if e.get("event") == "ready"), None)
        if ready is None:
            return
        self.announce_resume = False
        loaded = next((e for e in since if e.get("event") == "checkpoint_loaded"), None)
        if loaded is None:
            print("resumed from the beginning (step 0): no snapshot or checkpoint to load", file=sys.stderr)
        else:
            print(f"resumed from step {loaded.get('step')} ({loaded.get('tier') or 'disk'})", file=sys.stderr)

    def on_user_code_error(self, decision: Decision, outcome: Outcome, step: int) -> int:
        """One line: the exception and the user's file:line. No log excerpt (the line is the
        excerpt) and no advice to run the command again: it fails the same way until the
        code is fixed."""
        self.record_user_code_error()
        record_failure(self.run, error=decision.error, restarts=self.restarts(), **self.failure)
        print(f"error: {decision.error}; log {self.failure.get('log')}", file=sys.stderr)
        return 1

    def on_stop(self, decision: Decision, outcome: Outcome, step: int) -> int:
        checkpoint = record_stopped(self.run, by=outcome.cause, restarts=self.restarts(), job_id=self.job_id)
        print(stopped_line(outcome.cause, checkpoint))
        return EXIT_STOPPED

    def on_fail(self, decision: Decision, outcome: Outcome, step: int) -> int:
        error = decision.error
        log = self.failure.get("log")
        if outcome.kind is Kind.CONFIG_ERROR:  # the worker's own line, as it would say it
            error = outcome.cause.split(": ", 1)[1].removeprefix("error: ")
            record_failure(self.run, error=error, restarts=self.restarts(), **self.failure)
            print(f"error: {error} (worker rank {self.failure['rank']}; log {log})", file=sys.stderr)
            return EXIT_CONFIG
        record_failure(self.run, error=error, restarts=self.restarts(), **self.failure)
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
