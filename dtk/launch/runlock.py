"""One writer per run directory: the lock a launch takes before it writes into the run.

Two jobs writing one run directory delete each other's checkpoints (a save replaces an
unfinished folder of its step, retention deletes folders newer than the step it just
committed) and rewrite plan.json under each other. So every launch takes RUN_DIR/lock:

- an exclusive `flock` on the file while the launch writes (the local driver keeps it for
  its whole life and its workers inherit the descriptor: the kernel drops it when the last
  of them ends, however it ends);
- in the file, who holds the run: `{"kind": "local", "job_id": "local-PID", "host", "pid"}`
  or `{"kind": "slurm", "job_id": "123"}`. A Slurm job holds the run while Slurm says it is
  not ended (pending, running, requeued, ...), with no process of ours alive on this host.

A second launch is refused with an `error:` line that names the live job and how to follow
it. No torch here: the login node takes the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.common.rundir import RUN_LOCK

LOCK = RUN_LOCK

# Slurm states after which the job will not run again by itself (NODE_FAIL and PREEMPTED
# are not here: a requeueable job goes back to PENDING after them).
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


def read_holder(run_path: Path) -> dict[str, Any] | None:
    """Who last took the run's lock (None: nobody, or a file torn by a killed writer)."""
    try:
        holder = json.loads((run_path / LOCK).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another dtk.submit (it is starting right now)"
    if holder.get("kind") == "slurm":
        return f"Slurm job {holder.get('job_id')}"
    return f"local job {holder.get('job_id')} (dtk.submit pid {holder.get('pid')} on {holder.get('host')})"


class RunLock:
    """Held by one launch; `acquire` refuses a run directory another live job writes."""

    def __init__(self, run_path: Path) -> None:
        self.run_path = run_path
        self._fd: int | None = None

    def acquire(self, *, job_state: Callable[[str], str | None]) -> None:
        """Take the lock, or raise UserError naming the job that holds the run. `job_state`
        asks Slurm about a Slurm holder (dtk.launch.slurmctl.job_state)."""
        self.run_path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run_path / LOCK, os.O_RDWR | os.O_CREAT, 0o664)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_holder(self.run_path)
            raise UserError(self._busy(_describe(holder), "running" if holder else "")) from None
        self._fd = fd
        holder = read_holder(self.run_path)
        if holder and holder.get("kind") == "slurm" and holder.get("job_id"):
            try:
                state = job_state(str(holder["job_id"]))
            except Exception as exc:  # Slurm not installed here, or not answering
                self.release()
                raise UserError(
                    f"{self.run_path}: the run was last submitted as Slurm job {holder['job_id']}, and Slurm cannot"
                    f" say whether it still runs ({' '.join(str(exc).split())[:200]}); try again when Slurm answers"
                ) from None
            if state is not None and state not in ENDED:
                self.release()
                raise UserError(self._busy(_describe(holder), state))

    def _busy(self, who: str, state: str) -> str:
        said = f" ({state})" if state else ""
        return (
            f"run directory {self.run_path} is in use by {who}{said}; a second launch would write into the same"
            f" checkpoints. Follow it: python -m dtk.status {self.run_path}"
        )

    def record(self, *, kind: str, job_id: str) -> None:
        """Say who holds the run (in the locked file itself: replacing it would drop the flock)."""
        assert self._fd is not None, "record() before acquire()"
        holder = {"kind": kind, "job_id": job_id, "host": socket.gethostname(), "pid": os.getpid(),
                  "time": round(time.time(), 3)}
        data = (json.dumps(holder) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def fileno(self) -> int:
        """The locked descriptor: a process that inherits it holds the run too, until it exits
        (the local driver hands it to its workers)."""
        assert self._fd is not None, "fileno() before acquire()"
        return self._fd

    def release(self) -> None:
        if self._fd is not None:
            # Closing, not LOCK_UN: an unlock would free the run for the workers that inherited
            # the descriptor too; closed, the lock lasts until the last of them exits.
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.release()
