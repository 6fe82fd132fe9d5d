"""Start, identify and stop the lab's daemons.

Every daemon is started in its own background mode (it forks and writes a pid file), so
it is never a child of the Python process that started it: `up` can run inside pytest or
a short CLI call, and the daemons outlive it without waiting on it to reap them. A daemon
is remembered by pid *and* start time, so `down` never signals an unrelated process that
reused a pid; which other processes belong to the lab is decided in ownership.py.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from dtk.common.processes import process_start, same_start


class DaemonError(RuntimeError):
    """A daemon did not start or would not stop; the message says where its log is."""


@dataclass(frozen=True)
class Daemon:
    """One process the lab started. `label` is what users see ("slurmd node2")."""

    label: str
    pid: int
    create_time: float
    """Seconds since the epoch, for people; `start` is what identifies the process."""
    start: str = ""
    """dtk.common.processes.process_start: fixed for the process's life (empty in an older record)."""

    @classmethod
    def of(cls, label: str, proc: psutil.Process) -> Daemon:
        return cls(label, proc.pid, proc.create_time(), process_start(proc.pid))

    @property
    def program(self) -> str:
        return self.label.split()[0]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Daemon:
        return cls(label=data["label"], pid=int(data["pid"]), create_time=float(data["create_time"]),
                   start=str(data.get("start", "")))


def find_process(daemon: Daemon) -> psutil.Process | None:
    """The running process that is `daemon`, or None if it exited (a zombie has exited)."""
    try:
        proc = psutil.Process(daemon.pid)
        same = (same_start(daemon.start, daemon.create_time, process_start(daemon.pid), proc.create_time())
                and proc.name() == daemon.program)
        if same and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return None


def is_alive(daemon: Daemon) -> bool:
    return find_process(daemon) is not None


def start(label: str, argv: list[str], pid_file: Path, *, output: Path, log: Path,
          user: str | None = None, timeout_s: float = 5.0) -> Daemon:
    """Run a self-daemonizing program and return the daemon it leaves behind.

    `output` receives what the program prints before it detaches (a config error, for
    instance); afterwards it writes to its own `log`, which errors quote. A daemon that
    has not written its pid file after `timeout_s` has failed (they take milliseconds)."""
    pid_file.unlink(missing_ok=True)  # a stale pid file would name a dead process
    with output.open("ab") as out:
        try:
            result = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    user=user, group=user, extra_groups=[] if user else None,
                                    timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise DaemonError(f"{label} did not detach within {timeout_s:.0f} s; see {output}") from None
    if result.returncode != 0:
        raise DaemonError(f"{label} failed to start (exit {result.returncode}): {tail(output)}")
    pid = _wait_for_pid(pid_file, timeout_s)
    if pid is None:
        raise DaemonError(f"{label} did not start: {tail(log)}")
    try:
        return Daemon.of(label, psutil.Process(pid))
    except psutil.NoSuchProcess:
        raise DaemonError(f"{label} exited right after starting: {tail(log)}") from None


def _wait_for_pid(pid_file: Path, timeout_s: float) -> int | None:
    # The parent exits as soon as it has forked; the child writes the pid file a moment later.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = pid_file.read_text().strip()
            if text:
                return int(text)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.02)
    return None


def stop(daemons: list[Daemon], *, grace_s: float = 10.0) -> list[str]:
    """SIGTERM the daemons that still run, SIGKILL those that outlive `grace_s`.
    Returns one report line per daemon."""
    running = {d: p for d in daemons if (p := find_process(d)) is not None}
    killed = terminate(list(running.values()), grace_s=grace_s)
    lines = []
    for d in daemons:
        if d not in running:
            lines.append(f"{d.label} (pid {d.pid}) was not running")
        elif d.pid in killed:
            lines.append(f"killed {d.label} (pid {d.pid}) after {grace_s:.0f} s")
        else:
            lines.append(f"stopped {d.label} (pid {d.pid})")
    return lines


def terminate(procs: list[psutil.Process], *, grace_s: float = 10.0) -> set[int]:
    """SIGTERM `procs`, SIGKILL those alive after `grace_s`; the pids that needed SIGKILL."""
    for proc in procs:
        _signal(proc, signal.SIGTERM)
    alive = wait_gone(procs, grace_s)
    kill(alive)
    return {p.pid for p in alive}


def kill(procs: list[psutil.Process] | tuple[psutil.Process, ...]) -> None:
    """SIGKILL `procs` and wait until they are gone."""
    for proc in procs:
        _signal(proc, signal.SIGKILL)
    survivors = wait_gone(list(procs), 5.0)
    if survivors:
        raise DaemonError("these lab processes survived SIGKILL: " + ", ".join(str(p.pid) for p in survivors))


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until each process exited; return those still running at the timeout.

    Not psutil.wait_procs: these are not our children, and it waits until init reaps
    them, which some inits (this machine's) do late. A zombie counts as gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in procs if running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def running(proc: psutil.Process) -> bool:
    """True while `proc` (the very process, not a later one with its pid) runs."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(proc: psutil.Process, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def tail(path: Path, num_lines: int = 3) -> str:
    """The last lines of a log, joined on one line, for an error message."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return f"(no log at {path})"
    return " | ".join(lines[-num_lines:]) + f" (log: {path})"
