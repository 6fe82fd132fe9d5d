"""The memory tier's store root, trusted only when it is this user's own, and the sweep of
stores that runs left behind (checkpoint.memory_every). Torch-free.

The store lives in a folder every user may write (/dev/shm) under a name anyone can
predict, `dtk-<uid>`: another local user could make that folder first, then read every
weight and optimizer state written into it, or put a forged snapshot in a run's place. So
the run's user makes the root with mode 0700, and each time the tier uses it (at a start,
each snapshot, a restore, its removal) it is opened with O_NOFOLLOW and checked:

- a folder, not a symlink (O_NOFOLLOW | O_DIRECTORY);
- owned by this user;
- no write for group or others (a folder of this user's own with read bits, as an older
  dtk made it, has them taken away: nobody else could have written into it);
- its parent is sticky or writable by its owner only, so no other user can rename the
  root away and put another in its place between the check and a use.

A root that fails is refused (`StoreRefused`, one line): the tier is off for that start and
the run goes on with disk checkpoints. Below the root every folder is made 0700 and every
file 0600 (dtk.checkpoint.memory.store).

Each run's folder holds `owner.json` (the run directory, the Slurm job, the node). A job
that fails, or is stopped with --now, leaves its store on every node but the driver's (the
driver removes its own node's); so every worker start on a node (the tier's start, or
`sweep_host` where the tier is off) first sweeps this user's stores whose run is no longer
running: its run directory is gone, the newest of its lifecycle events is an end
(finished, failed, stopped), or its local driver on this host was killed before it wrote
one. Removing a store is always safe: the disk is the durable tier, and a restore that
finds a store gone falls back to it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import time
from pathlib import Path

from dtk.common.processes import driver_alive
from dtk.common.rundir import RunDir, memory_store

OWNER = "owner.json"  # in a run's folder of the store, not in the run directory
LIFECYCLE = ("submitted", "resubmitted", "started", "relaunched", "requeued", "finished", "failed", "stopped")
ENDS = ("finished", "failed", "stopped")


class StoreRefused(Exception):
    """The store's root is not this user's own: one line, the tier is off."""


def store_root(run_path: Path) -> Path:
    """The root this run's store is under (`<DTK_MEMORY_STORE_ROOT or /dev/shm>/dtk-<uid>`)."""
    return memory_store(run_path).parent


def check_root(root: Path, *, make: bool = False) -> None:
    """Raise StoreRefused unless `root` is a folder of this user's that no one else can write
    or swap; `make`: create it and its missing parents (mode 0700) when it is not there."""
    parent = root.parent
    if make and not parent.exists():
        try:
            make_dirs(parent)
        except OSError as exc:
            raise StoreRefused(f"{parent} cannot be made: {exc.strerror}") from None
    try:
        pst = os.stat(parent)
    except OSError as exc:
        raise StoreRefused(f"{parent}: {exc.strerror}") from None
    if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
        raise StoreRefused(f"{parent} is writable by group or others and not sticky: another user could replace"
                           f" {root}")
    if make:
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StoreRefused(f"{root} cannot be made: {exc.strerror}") from None
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StoreRefused(f"{root} is a symlink or not a folder") from None
        raise StoreRefused(f"{root}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise StoreRefused(f"{root} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
        if st.st_mode & 0o022:
            raise StoreRefused(f"{root} has mode {stat.S_IMODE(st.st_mode):04o}: group or others can write in it")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)  # this user's own, readable by others: made by an older dtk
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """`path` and its missing parents, each mode 0700 (Path.mkdir gives parents the umask's mode)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            if not folder.is_dir():  # a file in its place: the write fails with that
                raise


def write_owner(run_store: Path, *, run_path: Path, node: str) -> None:
    """Say whose store this is (run directory, Slurm job, node): what a later sweep reads."""
    make_dirs(run_store)
    record = {"run": str(Path(run_path).resolve()), "job_id": os.environ.get("SLURM_JOB_ID"), "node": node,
              "time": round(time.time(), 3)}
    tmp = run_store / f".{OWNER}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(record, fh)
    os.replace(tmp, run_store / OWNER)


def run_over(run_path: Path) -> bool:
    """Whether the run of a store is no longer running: its directory is gone, the newest of
    its lifecycle events is an end, or it is a start of a local driver on this host that is
    no longer alive (killed before it could write an end). A run just submitted, started by
    a live driver, requeued or relaunched runs."""
    run = RunDir(Path(run_path))
    if not run.path.is_dir():
        return True
    last: dict = {}
    for event in run.events_list():
        if event.get("event") in LIFECYCLE:
            last = event
    if last.get("event") in ENDS:
        return True
    here = last.get("event") == "started" and last.get("driver_pid") and last.get("nodes") == [socket.gethostname()]
    return bool(here) and not driver_alive(last)


def sweep(root: Path, *, keep: Path) -> list[Path]:
    """Remove this user's stores under a checked `root` whose run is over, but `keep` (the
    store of the run starting). A folder without a readable owner record is left alone."""
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for folder in entries:
        if folder == keep or folder.is_symlink() or not folder.is_dir():
            continue
        try:
            owner = json.loads((folder / OWNER).read_text())
            run_path = Path(owner["run"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if run_over(run_path) and remove_folder(folder, prefix=".swept"):
            removed.append(folder)
    return removed


def remove_folder(folder: Path, *, prefix: str) -> bool:
    """Rename `folder` out of every name a listing looks for (in one step, so no listing sees
    it half removed), then delete it; False when it could not be renamed (gone, or busy)."""
    gone = folder.with_name(f"{prefix}-{folder.name}-{os.getpid()}")
    try:
        os.replace(folder, gone)
    except OSError:
        return False
    shutil.rmtree(gone, ignore_errors=True)
    return True


def sweep_host(run_path: Path) -> list[Path]:
    """A start of `run_path` on this node with the tier off: the stores that ended runs left here
    (the tier's own start sweeps them otherwise). A root that is missing or not this user's
    own is not touched."""
    root = store_root(run_path)
    if not root.is_dir():
        return []
    try:
        check_root(root)
    except StoreRefused:
        return []
    return sweep(root, keep=memory_store(run_path))
