"""The audit log of a run root: who did what to which run, when, from where.

    <run.root>/audit/00000001.json   one file per action, read-only, owned by who acted
    <run.root>/audit.head            each entry's number and hash, appended (append-only)

Each command that acts on a run (submit, stop, requeue, drill, checkpoint export and
delete) calls `record` once; `python -m dtk.status` shows a run's entries and
`python -m dtk.access audit RUN_ROOT` checks the whole log. The log lives in the run root,
not in a run directory, so that it outlives a deleted run.

Why a file per entry: the kernel records who created each file, and in the sticky audit
folder nobody removes or rewrites another user's file. An entry that claims another user
(uid or name) than its file's owner is a forgery, and is reported, never shown as genuine;
the name shown is the owner's, from the user database, never the entry's own word.
`sudo_user` cannot be checked that way, so it is shown as a claim. Each entry
holds the SHA-256 of the one before it, so an entry removed or changed by its own writer
breaks the chain where it was; the head file, append-only under an access policy (chattr
+a: nobody takes a line back), tells when the newest entries were removed or replaced. An entry is written in full to a
temporary file and then linked to its number, so a reader never sees half of one and two
writers never take the same number. Stdlib only: the login node and the driver write it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import socket
import stat
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.common.rundir import PLAN_JSON

AUDIT_DIR = "audit"
HEAD_FILE = "audit.head"
OLD_FILE = "audit.jsonl"  # the unchained log of an older dtk: reported, never shown as genuine
ACTIONS = ("submit", "stop", "cancel", "requeue", "resubmit", "drill", "export", "delete_checkpoint", "readmit")
_ENTRY = re.compile(r"^(\d{8,})\.json$")  # 8 digits, more after 99999999


def audit_path(run_root: Path) -> Path:
    return Path(run_root) / AUDIT_DIR


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
    if target.exists() and not os.access(target, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the audit log {path} as user {current_user()['name']}: permission denied;"
                        " actions on runs under this run.root are recorded there (ask a maintainer to check"
                        " the run root's group and modes, see docs/access.md)")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _numbers(folder: Path) -> list[int]:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_ENTRY.match, names) if m)


def _entry_name(seq: int) -> str:
    return f"{seq:08d}.json"


def _read_bytes(folder: Path, seq: int) -> tuple[bytes, os.stat_result] | None:
    """An entry's bytes and its file's status, never through a link; None if it is gone."""
    try:
        fd = os.open(folder / _entry_name(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, OSError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(), st
    finally:
        os.close(fd)


def record(run_root: Path, action: str, *, run: str | None = None, config_hash: str | None = None,
           job_ids: Iterable[str] = (), **details: Any) -> dict[str, Any]:
    """Append one entry to the chain, durably; returns the entry."""
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
    folder = audit_path(run_root)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        check_writable(run_root)
        raise
    tmp = folder / f".tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        while True:
            numbers = _numbers(folder)
            seq = numbers[-1] + 1 if numbers else 1
            before = _read_bytes(folder, seq - 1) if numbers else None
            chained = {"seq": seq, "prev": _digest(before[0]) if before else None, **entry}
            data = (json.dumps(chained, default=str) + "\n").encode()
            _write_new(tmp, data)
            try:
                os.link(tmp, folder / _entry_name(seq))  # fails if another writer took the number
                break
            except FileExistsError:
                os.unlink(tmp)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(folder)
    _advance_head(Path(run_root) / HEAD_FILE, seq, _digest(data))
    return chained


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _advance_head(path: Path, seq: int, digest: str) -> None:
    """Append `seq digest` to the head. Under an access policy the head is append-only
    (prepare sets chattr +a): nobody can take a line back, so an entry removed later by its
    own writer still shows. Elsewhere (a run root of one's own) the head is the creator's:
    others' entries still chain, and are checked against the lines that are there."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.write(fd, f"{seq:08d} {digest}\n".encode())
            os.fsync(fd)
    finally:
        os.close(fd)


def _head_lines(raw: bytes) -> list[tuple[int, str]]:
    out = []
    for line in raw.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and len(parts[1]) == 64:
            out.append((int(parts[0]), parts[1]))
    return out


@dataclass
class AuditLog:
    """The genuine entries, oldest first, and what is wrong with the log (empty: intact)."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def verify(run_root: Path) -> AuditLog:
    """Every entry checked: its file's owner is the user it names, it follows the one
    before it (number and hash), and the chain reaches the head record."""
    folder, log = audit_path(run_root), AuditLog()
    previous: tuple[int, bytes] | None = None
    try:
        numbers = _numbers(folder)
    except PermissionError:
        log.problems.append(f"{folder}: permission denied; the audit log cannot be read")
        return log
    for seq in numbers:
        found = _read_bytes(folder, seq)
        if found is None:
            log.problems.append(f"entry {seq}: not a regular file (a link?); skipped")
            continue
        data, st = found
        try:
            entry = json.loads(data)
            claimed = int(entry["user"]["uid"])
        except (ValueError, KeyError, TypeError):
            log.problems.append(f"entry {seq}: not an audit entry; skipped")
            continue
        if previous is None and seq != 1:
            log.problems.append(f"entries 1 to {seq - 1} are missing: the start of the log was removed")
        elif previous is not None and seq != previous[0] + 1:
            log.problems.append(f"entries {previous[0] + 1} to {seq - 1} are missing: removed from the log")
        elif previous is not None and entry.get("prev") != _digest(previous[1]):
            log.problems.append(f"entry {seq} does not follow entry {previous[0]}: one of them was changed")
        if entry.get("seq") != seq:
            log.problems.append(f"entry {seq}: its file was renamed (it says entry {entry.get('seq')})")
        previous = (seq, data)
        owner = _user_name(st.st_uid)
        stated = entry["user"].get("name")
        if st.st_uid != claimed or stated != owner:
            log.problems.append(f"entry {seq} is forged: it names user {_shown(stated)}({claimed}) but"
                                f" was written by {owner}({st.st_uid}); not shown")
            continue
        log.entries.append(entry)
    _check_head(Path(run_root) / HEAD_FILE, previous, log)
    if (Path(run_root) / OLD_FILE).exists():
        log.problems.append(f"{OLD_FILE}: the unchained log of an older dtk; its entries are not verified, not shown")
    return log


def _check_head(path: Path, last: tuple[int, bytes] | None, log: AuditLog) -> None:
    """Every entry the head names is there, with the bytes it had when written."""
    try:
        lines = _head_lines(path.read_bytes())
    except (FileNotFoundError, PermissionError):
        return
    newest = max((seq for seq, _ in lines), default=0)
    if newest > (last[0] if last else 0):
        ends = f"ends at entry {last[0]}" if last else "is empty"
        log.problems.append(f"the log {ends} but {HEAD_FILE} names entry {newest}: newer entries were removed")
    folder = audit_path(path.parent)
    replaced = sorted({seq for seq, digest in lines if seq <= (last[0] if last else 0)
                       and ((found := _read_bytes(folder, seq)) is None or _digest(found[0]) != digest)})
    if replaced:
        log.problems.append(f"{HEAD_FILE} names entries that were removed or replaced since:"
                            f" {', '.join(map(str, replaced))}")


def _shown(text: Any) -> str:
    """A value an entry states, printable: as it is when printable ASCII, else escaped."""
    text = str(text)
    return text if text.isascii() and text.isprintable() else ascii(text)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


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


def record_or_warn(run_dir: Path, action: str, *, job_ids: Iterable[str] = (), **details: Any) -> None:
    """`record_run` for the driver inside a job (a requeue, a resubmission): an entry it
    cannot write is one warning line on stderr, and the requeue goes on."""
    try:
        record_run(run_dir, action, job_ids=job_ids, **details)
    except (OSError, UserError) as exc:
        print(f"driver: could not record {action} in the audit log of {run_root_of(Path(run_dir))}: {exc}",
              file=sys.stderr, flush=True)


def read(run_root: Path, *, run: str | None = None) -> list[dict[str, Any]]:
    """Genuine entries oldest first, of one run when `run` is given (`verify` says what
    else the log holds)."""
    return [e for e in verify(run_root).entries if run is None or e.get("run") == run]


def describe(entry: dict[str, Any]) -> str:
    """One line: `2025-01-01T10:00:00Z  alice@login1  submit  job 123  config 1a2b3c4d5e`."""
    user = entry.get("user") or {}
    who = f"{_shown(user.get('name'))}({user.get('uid')})@{_shown(entry.get('host'))}"
    if user.get("sudo_user"):  # the environment's word, which no file owner confirms
        who += f" claims sudo_user={_shown(user['sudo_user'])}"
    parts = [entry.get("time", "?"), who, entry.get("action", "?")]
    if entry.get("job_ids"):
        parts.append("job " + ",".join(entry["job_ids"]))
    if entry.get("config_hash"):
        parts.append(f"config {entry['config_hash']}")
    known = {"seq", "prev", "time", "unix_time", "user", "host", "action", "run", "config_hash", "job_ids"}
    parts += [f"{k}={v}" for k, v in entry.items() if k not in known]
    return "  ".join(str(p) for p in parts)
