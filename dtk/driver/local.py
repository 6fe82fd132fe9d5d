"""The driver on the local cluster: start the workers on this machine and watch them.

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

from dtk.driver.logs import error_line
from dtk.driver.record import record_failure
from dtk.plan.plan import Plan
from dtk.rundir import RunDir
from dtk.worker.codes import EXIT_CONFIG, EXIT_STOPPED
from dtk.worker.env import driver_env, rank_env

POLL_S = 0.2
STOP_GRACE_S = 60.0  # SIGTERM -> the workers agree, save and exit; then SIGKILL


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(*, rank: int, world: int, local_world: int, port: int, restart: int, plan: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        rank_env(rank=rank, local_rank=rank % local_world, world_size=world, local_world_size=local_world,
                 node_rank=rank // local_world),
        # The same variables the Slurm supervisor sets; a local start recovers from nothing.
        **driver_env(master_addr="127.0.0.1", master_port=port, restart=restart, plan=plan, recovery_from=None),
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
    def __init__(self, plan: Plan, run: RunDir, *, progress=None) -> None:
        self.plan = plan
        self.run = run
        self.progress = progress
        self.procs: list[subprocess.Popen] = []

    def start(self) -> Path:
        restart = self.run.starts()
        logs = self.run.log_dir(restart)
        logs.mkdir(parents=True, exist_ok=True)
        port = free_port()
        world = self.plan.world_size
        self.run.event(
            "started",
            restart=restart,
            job_id=f"local-{os.getpid()}",
            nodes=[socket.gethostname()],
            world_size=world,
            driver_pid=os.getpid(),
        )
        for rank in range(world):
            log = open(logs / f"rank_{rank}.log", "ab")
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "dtk.worker", str(self.run.path)],
                    env=worker_env(rank=rank, world=world, local_world=world, port=port, restart=restart,
                                   plan=self.run.plan_json),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            )
            log.close()
        pids = [p.pid for p in self.procs]
        (logs / "pids").write_text("\n".join(map(str, pids)) + "\n")
        return logs

    def stop(self) -> None:
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in alive:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def watch(self, logs: Path) -> int:
        """Wait for the workers: 0 when all finished, EXIT_STOPPED after an agreed stop,
        EXIT_CONFIG for a worker's configuration error, 1 for any other failure."""
        while True:
            codes = [p.poll() for p in self.procs]
            if self.progress is not None:
                self.progress.poll()
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0, EXIT_STOPPED)]
            if failed:
                # A configuration error explains the others' fate (their peer left).
                rank, code = min(failed, key=lambda f: f[1] != EXIT_CONFIG)
                self.stop()
                return self._failed(rank, code, logs)
            if all(c in (0, EXIT_STOPPED) for c in codes):
                if self.progress is not None:
                    self.progress.poll(final=True)
                if EXIT_STOPPED in codes:
                    print("stopped on a signal after committing a checkpoint; run the same command to continue")
                    return EXIT_STOPPED
                return 0
            time.sleep(POLL_S)

    def _failed(self, rank: int, code: int, logs: Path) -> int:
        log = logs / f"rank_{rank}.log"
        said = error_line(log) if code == EXIT_CONFIG else None
        if said:  # the worker's own error line says it all; starting again cannot fix it
            error = said.removeprefix("error: ")
            record_failure(self.run, error=error, restarts=self.run.starts() - 1, rank=rank, exit_code=code,
                           log=str(log))
            print(f"error: {error} (worker rank {rank}; log {log})", file=sys.stderr)
            return EXIT_CONFIG
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        record_failure(
            self.run, error=f"worker rank {rank} {how}", restarts=self.run.starts() - 1, rank=rank, exit_code=code, log=str(log)
        )
        excerpt = tail(log)
        if excerpt:
            print(f"--- last lines of {log}\n{excerpt}\n---", file=sys.stderr)
        print(
            f"error: worker rank {rank} {how}; the run stopped. Log: {log}. "
            "Running the same command again resumes from the latest checkpoint.",
            file=sys.stderr,
        )
        return 1

    def run_to_end(self) -> int:
        logs = self.start()
        previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            return self.watch(logs)
        except (KeyboardInterrupt, _Terminated) as exc:
            why = str(exc) or "SIGINT"
            print(f"\n{why}: the workers save at the end of this step and stop", file=sys.stderr)
            self.stop()
            return 130
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
