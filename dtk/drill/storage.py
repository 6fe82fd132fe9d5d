"""The storage drill: make a run's checkpoint storage fail for real, then give it back.

`python -m dtk.drill storage RUN_DIR --hold S` bind-mounts RUN_DIR/checkpoints onto itself
read-only for S seconds (root only): every save in that time fails in the kernel with
`Read-only file system` - mkdir, the shards, the manifest - while the checkpoints already
committed stay readable and untouched. Then it unmounts, and the next save commits.
What a vanished or full mount does to a save is the same path: the save's folder never
gets its manifest (docs/recovery.md).

No torch here: the drill runs next to a live job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from dtk.common.errors import UserError

BUSY_WAIT_S = 10.0


def _when_not_busy(argv: list[str], *, wait_s: float) -> subprocess.CompletedProcess:
    """Run `mount ...` or `umount ...`; while it says the mount is busy (a file open for
    writing on it: a save in flight, a worker on its way out), try again for `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode == 0 or "busy" not in proc.stderr or time.monotonic() >= deadline:
            return proc
        time.sleep(0.2)


def _mount(*args: str, wait_s: float = 0.0) -> None:
    proc = _when_not_busy(["mount", *args], wait_s=wait_s)
    if proc.returncode != 0:
        raise UserError(f"mount {' '.join(args)}: {' '.join((proc.stderr or proc.stdout).split())}")


def is_mountpoint(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)]).returncode == 0


def break_storage(folder: Path) -> None:
    """Make `folder` read-only for every process on this machine (a bind mount over itself).
    A save that opens a file between the bind and the read-only remount makes the remount
    busy: it is tried again until that file is closed (BUSY_WAIT_S at most)."""
    if os.geteuid() != 0:
        raise UserError("the storage drill makes a mount read-only and needs root (sudo)")
    folder.mkdir(parents=True, exist_ok=True)
    if is_mountpoint(folder):
        raise UserError(f"{folder} is a mount point already (a drill still running?); not touching it")
    _mount("--bind", str(folder), str(folder))
    try:
        _mount("-o", "remount,ro,bind", str(folder), wait_s=BUSY_WAIT_S)
    except UserError:
        restore_storage(folder)
        raise


def restore_storage(folder: Path, *, busy_wait_s: float = BUSY_WAIT_S) -> None:
    """Unmount the read-only bind mount. A process that still has a file open on it (a save
    that failed a moment ago, a worker on its way out) makes it busy: retried for
    `busy_wait_s`, then detached (umount --lazy), so the folder is writable again at once for
    every new file and the read-only view goes when its last file is closed."""
    proc = _when_not_busy(["umount", str(folder)], wait_s=busy_wait_s)
    if proc.returncode == 0:
        return
    if "busy" in proc.stderr:
        proc = subprocess.run(["umount", "--lazy", str(folder)], capture_output=True, text=True)
        if proc.returncode == 0:
            return
    raise UserError(f"umount {folder}: {' '.join(proc.stderr.split())}; restore it by hand: umount {folder}")


def storage_drill(checkpoints: Path, *, hold_s: float) -> str:
    """Break the storage, wait `hold_s` (SIGINT or SIGTERM end the wait early), restore it."""
    break_storage(checkpoints)
    t0 = time.monotonic()
    previous = {sig: signal.signal(sig, lambda *_: (_ for _ in ()).throw(InterruptedError()))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        print(f"{checkpoints} is read-only for {hold_s:g} s", flush=True)
        time.sleep(hold_s)
    except InterruptedError:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        restore_storage(checkpoints)
    return f"{checkpoints} was read-only for {time.monotonic() - t0:.1f} s and is writable again"
