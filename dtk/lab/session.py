"""Who is using the lab: one session at a time.

The lab is one shared thing on a machine: a test session restarts, drains and fails its
nodes, and a person's `up` (which would switch a cancel-mode lab back to requeue) or `down
--force` (which ends every job) in the middle of it changes what the tests are looking at.
So `up` records the session it runs in, in `session.json` under the lab's folder, and
every later `up`, `down` and `slow` from another session is refused with one line naming
the session that holds the lab. `down` ends the session.

A session is a process and everything under it: the shell that typed `sudo python -m
dtk.lab up` (the process above sudo), or a test session (`DTK_LAB_SESSION=PID`, set by
tests/conftest.py's `lab` fixture for the pytest process, so its own commands and
subprocesses are of it). It holds the lab while that process lives (pid and start time,
so a reused pid is not taken for it); a session whose process has ended holds nothing,
and the next `up` takes the lab over by itself. `--take` takes over a live one.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import psutil

from dtk.lab.files import LabLayout
from dtk.lab.programs import LabError
from dtk.lab.record import invoking_user

SESSION_ENV = "DTK_LAB_SESSION"
"""The pid of the process whose session this process is in (a test session sets it)."""
LAUNCHERS = frozenset({"sudo", "su", "doas", "flock", "timeout", "env"})
"""Processes between a person's shell and the command: the session is the process above them."""


@dataclass(frozen=True)
class Session:
    """The process that holds the lab, as recorded in session.json."""

    pid: int
    created: float
    """The process's start time (psutil's create_time): a pid reused later is another process."""
    user: str
    tty: str
    command: str
    since: float

    def alive(self) -> bool:
        try:
            return abs(psutil.Process(self.pid).create_time() - self.created) < 0.01
        except psutil.Error:
            return False

    def line(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{self.user}'s {self.command} (pid {self.pid}, {self.tty}, since {since})"


def of_process(pid: int, *, user: str | None = None) -> Session:
    """The session held by process `pid`, started now."""
    proc = psutil.Process(pid)
    with proc.oneshot():
        tty = proc.terminal() or "no terminal"
        argv = proc.cmdline()
        command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv[:4])) or proc.name()
        return Session(pid, proc.create_time(), user or invoking_user(), tty, command, round(time.time(), 3))


def caller_pid(environ: dict[str, str] | None = None) -> int:
    """The process whose session this process is in: $DTK_LAB_SESSION when it names a live
    process that is this one or above it, else the first process above this one that is not
    a launcher (sudo, flock, ...): the shell the command was typed in, or the script it ran in."""
    value = (os.environ if environ is None else environ).get(SESSION_ENV, "")
    me = psutil.Process()
    if value.isdigit() and int(value) in {me.pid, *(p.pid for p in me.parents())}:
        return int(value)
    for parent in me.parents():
        if parent.name() not in LAUNCHERS:
            return parent.pid
    return me.pid


def read(layout: LabLayout) -> Session | None:
    """The recorded session, or None when there is none or it is unreadable."""
    try:
        return Session(**json.loads(layout.session.read_text()))
    except (FileNotFoundError, TypeError, ValueError):
        return None


def holder(layout: LabLayout) -> Session | None:
    """The live session that holds the lab, or None (no session, or its process ended)."""
    found = read(layout)
    return found if found is not None and found.alive() else None


def is_in(session: Session) -> bool:
    """Whether this process is the session's process or runs under it."""
    me = psutil.Process()
    return any(p.pid == session.pid and abs(p.create_time() - session.created) < 0.01 for p in [me, *me.parents()])


def check(layout: LabLayout, *, doing: str, take: bool = False) -> Session | None:
    """Refuse `doing` while another live session holds the lab (unless `take`); return
    the session that holds it, if it is this process's own. Call it under the lab's lock."""
    held = holder(layout)
    if held is None or is_in(held):
        return held
    if take:
        return None
    raise LabError(f"the lab is in use by another session: {held.line()}; {doing} would change the lab under it."
                   " Wait for it to end (python -m dtk.lab status shows it), or pass --take to take the lab over")


def claim(layout: LabLayout, *, doing: str, take: bool = False) -> Session:
    """The lab for this process's session (`check` first): recorded, unless it already holds it."""
    held = check(layout, doing=doing, take=take)
    if held is not None:
        return held
    mine = of_process(caller_pid())
    tmp = layout.session.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(mine)))
    tmp.replace(layout.session)
    return mine


def release(layout: LabLayout) -> None:
    """The session ends: the lab is free for the next."""
    layout.session.unlink(missing_ok=True)
