"""A process's identity and liveness, on the host that asks: whether a pid exists, when a
process started (fixed for its life, unlike an epoch time a clock adjustment moves), and
whether the local driver a run's `started` event names is still that process.

No torch, no stage: the login node (status, stop), the driver and the workers use it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists on this host (0 or less: no pid was recorded, not
    the caller's process group, which os.kill(0, 0) would ask about)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


def _start_ticks(pid: int) -> int | None:
    """Clock ticks from boot to the start of process `pid` (/proc/PID/stat field 22); None
    where /proc does not say (not Linux, or no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces.
    return int(stat[stat.rindex(b")") + 2:].split()[22 - 3])


def process_start(pid: int) -> str:
    """When process `pid` started, as `BOOT_ID:TICKS` (the kernel's boot id and `_start_ticks`):
    fixed for the life of the process. A start time in seconds since the epoch is not:
    psutil adds the boot time the kernel reports now, a whole second that moves when the
    clock is adjusted (NTP), so a process recorded at one time may not match itself later.
    Empty where /proc does not say."""
    ticks = _start_ticks(pid)
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    return f"{boot}:{ticks}" if ticks is not None else ""


def process_age(pid: int) -> float | None:
    """Seconds since process `pid` started, to a clock tick (the boot clock against
    `_start_ticks`); None where /proc does not say."""
    ticks = _start_ticks(pid)
    if ticks is None:
        return None
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


def same_start(recorded: str, epoch_recorded: float, now: str, epoch_now: float) -> bool:
    """Whether two readings of a process's start are the same process: by `process_start`
    where both have it, else by the epoch start times, to within the second that a clock
    adjustment moves them (a reused pid starts later than that)."""
    if recorded and now:
        return recorded == now
    return abs(epoch_now - epoch_recorded) < 1.5


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """What tells this process from a later one given the same pid: its start (`process_start`,
    and in seconds since the epoch for people and for hosts without /proc) and command name
    (recorded in the `started` event of a local driver)."""
    import psutil

    proc = psutil.Process(pid)
    return {"driver_pid": proc.pid, "driver_started": round(proc.create_time(), 3),
            "driver_start": process_start(proc.pid), "driver_name": proc.name()}


def driver_alive(started: dict[str, Any]) -> bool:
    """Whether the local driver a `started` event names still runs: its pid exists and,
    where the event recorded them, with the same start time and command name (a dead
    driver's pid given to another process is not the run running)."""
    import psutil

    pid = int(started.get("driver_pid") or 0)
    if not pid_alive(pid):
        return False
    if "driver_started" not in started:  # recorded by an older dtk: the pid is all there is
        return True
    try:
        now = process_identity(pid)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return (same_start(started.get("driver_start", ""), float(started["driver_started"]),
                       now["driver_start"], now["driver_started"])
            and now["driver_name"] == started.get("driver_name", now["driver_name"]))
