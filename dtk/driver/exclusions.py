"""Nodes this run will not use: `excluded_nodes.json` in the run directory.

Every later submission or requeue of the run passes them to Slurm (`--exclude`, and the
requeued job's ExcNodeList). The file is a history, one entry per exclusion: the node, the
job, why and when; an entry that was given back carries `readmitted` (by whom, why, when)
and no longer counts. A node comes back by `python -m dtk.nodes RUN_DIR --readmit NODE`,
or by the driver itself once Slurm reports it in service and a health job passed on it.

The live driver and `dtk.nodes` both change the file: every change is a read-modify-write
under an exclusive lock (`excluded_nodes.lock`) and lands by an atomic rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Iterator

from dtk.errors import UserError
from dtk.rundir import RunDir, write_json_atomic

FILE = "excluded_nodes.json"
LOCK = "excluded_nodes.lock"


def read_entries(run: RunDir) -> list[dict]:
    """Every entry, the re-admitted ones too (oldest first)."""
    try:
        return list(json.loads((run.path / FILE).read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def active(entries: list[dict]) -> list[dict]:
    return [e for e in entries if "readmitted" not in e]


def read_exclusions(run: RunDir) -> list[str]:
    """The nodes excluded now."""
    return [e["node"] for e in active(read_entries(run))]


@contextlib.contextmanager
def _locked(run: RunDir) -> Iterator[list[dict]]:
    """The entries to change in place; written back atomically when the block ends."""
    with open(run.path / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entries = read_entries(run)
            before = json.dumps(entries)
            yield entries
            if json.dumps(entries) != before:
                write_json_atomic(run.path / FILE, entries)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def add_exclusions(run: RunDir, nodes: list[str], *, job_id: str, reason: str) -> None:
    with _locked(run) as entries:
        known = {e["node"] for e in active(entries)}
        entries += [{"node": n, "job_id": job_id, "reason": reason, "time": round(time.time(), 3)}
                    for n in nodes if n not in known]


def readmit(run: RunDir, node: str, *, by: str, reason: str) -> dict:
    """Give `node` back to the run; the entry it had, now with `readmitted`. A node the
    run does not exclude is a UserError naming the ones it does."""
    with _locked(run) as entries:
        current = [e for e in active(entries) if e["node"] == node]
        if not current:
            now = sorted({e["node"] for e in active(entries)})
            raise UserError(f"--readmit {node}: the run does not exclude {node}"
                            f" (excluded now: {', '.join(now) or 'none'})")
        for entry in current:
            entry["readmitted"] = {"by": by, "reason": reason, "time": round(time.time(), 3)}
        return dict(current[-1])
