"""The audit log of a run root: who did what to which run, when, from where.

    <run.root>/audit.jsonl    one JSON object per action, appended, fsynced

Each command that acts on a run (submit, stop, requeue, drill, checkpoint export and
delete) calls `record` once; `python -m dtk.status` shows a run's entries. The file lives
in the run root, not in a run directory, so that it outlives a deleted run and one file
answers "who submitted what on this storage". Entries are only ever appended with one
`write` on an O_APPEND descriptor (concurrent writers never interleave a line) and fsynced
before the command goes on, so an entry a command printed survives a crash. Stdlib only:
the login node and the driver write it.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dtk.errors import UserError
from dtk.rundir import PLAN_JSON

AUDIT_FILE = "audit.jsonl"
ACTIONS = ("submit", "stop", "cancel", "requeue", "drill", "export", "delete_checkpoint", "readmit")


def audit_path(run_root: Path) -> Path:
    return Path(run_root) / AUDIT_FILE


def run_root_of(run_dir: Path) -> Path:
    """A run directory is `<run.root>/<run.name>`; its audit log is in the run root."""
    return Path(run_dir).resolve().parent


def current_user() -> dict[str, Any]:
    """The real user (uid and name); under sudo, also who ran sudo."""
    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry (containers): the number is the name
        name = str(uid)
    user: dict[str, Any] = {"uid": uid, "name": name}
    if uid == 0 and os.environ.get("SUDO_USER"):
        user["sudo_user"] = os.environ["SUDO_USER"]
    return user


def check_writable(run_root: Path) -> None:
    """Refuse an action up front when its audit entry could not be written afterwards."""
    path = audit_path(run_root)
    target = path if path.exists() else Path(run_root)
    if target.exists() and not os.access(target, os.W_OK):
        raise UserError(f"cannot write the audit log {path} as user {current_user()['name']}: permission denied;"
                        " actions on runs under this run.root are recorded there (ask a maintainer to check"
                        " the run root's group and modes, see docs/access.md)")


def record(run_root: Path, action: str, *, run: str | None = None, config_hash: str | None = None,
           job_ids: Iterable[str] = (), **details: Any) -> dict[str, Any]:
    """Append one entry and fsync it; returns the entry."""
    assert action in ACTIONS, f"unknown audit action {action!r}"
    now = time.time()
    entry: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "unix_time": round(now, 3),
        "user": current_user(),
        "host": socket.gethostname(),
        "action": action,
        "run": run,
        "config_hash": config_hash,
        "job_ids": [str(j) for j in job_ids],
        **details,
    }
    path = audit_path(run_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(entry, default=str) + "\n").encode()
    created = not path.exists()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o664)
    except PermissionError:
        check_writable(run_root)
        raise
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:  # the new name must survive a crash too
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return entry


def record_run(run_dir: Path, action: str, *, job_ids: Iterable[str] = (), **details: Any) -> dict[str, Any]:
    """`record` for an action on an existing run directory: its name and config hash come
    from its plan.json."""
    run_dir = Path(run_dir)
    try:
        plan = json.loads((run_dir / PLAN_JSON).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        plan = {}
    return record(run_root_of(run_dir), action, run=plan.get("run_name", run_dir.name),
                  config_hash=plan.get("config_hash"), job_ids=job_ids, **details)


def read(run_root: Path, *, run: str | None = None) -> list[dict[str, Any]]:
    """Entries oldest first, of one run when `run` is given; a torn last line is skipped."""
    entries = []
    try:
        with open(audit_path(run_root), encoding="utf-8") as fh:
            for line in fh:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if run is None or entry.get("run") == run:
                    entries.append(entry)
    except (FileNotFoundError, PermissionError):
        return []
    return entries


def describe(entry: dict[str, Any]) -> str:
    """One line: `2025-01-01T10:00:00Z  alice@login1  submit  job 123  config 1a2b3c4d5e`."""
    user = entry.get("user") or {}
    who = f"{user.get('name')}({user.get('uid')})@{entry.get('host')}"
    parts = [entry.get("time", "?"), who, entry.get("action", "?")]
    if entry.get("job_ids"):
        parts.append("job " + ",".join(entry["job_ids"]))
    if entry.get("config_hash"):
        parts.append(f"config {entry['config_hash']}")
    known = {"time", "unix_time", "user", "host", "action", "run", "config_hash", "job_ids"}
    parts += [f"{k}={v}" for k, v in entry.items() if k not in known]
    return "  ".join(str(p) for p in parts)
