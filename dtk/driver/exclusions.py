"""Nodes this run will not use: `excluded_nodes.json` in the run directory.

Every later submission or requeue of the run passes them to Slurm (`--exclude`, and the
requeued job's ExcNodeList). The file is a history, one entry per exclusion: the node, the
job, why and when; an entry that was given back carries `readmitted` (by whom, why, when)
and no longer counts. A node comes back by `python -m dtk.nodes RUN_DIR --readmit NODE`,
or by the driver itself once Slurm reports it in service and a health job passed on it.

Only names that pass the one node-name check (dtk/launch/nodenames.py) are written, read
back as exclusions, or given back: the file may have been written by anyone who may write
the run directory, and its names reach the next batch script (`#SBATCH --exclude=`).
`invalid_exclusions` lists the others, which dtk.nodes shows as invalid.

The live driver and `dtk.nodes` both change the file: every change is a read-modify-write
under an exclusive lock (`excluded_nodes.lock`) and lands by an atomic rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import sys
import time
from collections.abc import Iterator

from dtk.common.errors import UserError
from dtk.common.rundir import RunDir, write_json_atomic
from dtk.launch.nodenames import is_node_name, shown, split, warning

FILE = "excluded_nodes.json"
LOCK = "excluded_nodes.lock"


def read_entries(run: RunDir) -> list[dict]:
    """Every entry, the re-admitted ones too (oldest first)."""
    try:
        found = json.loads((run.path / FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    return [e for e in found if isinstance(e, dict) and "node" in e] if isinstance(found, list) else []


def active(entries: list[dict]) -> list[dict]:
    return [e for e in entries if "readmitted" not in e]


def read_exclusions(run: RunDir) -> list[str]:
    """The nodes excluded now (only valid node names: `invalid_exclusions` has the rest)."""
    return split(e["node"] for e in active(read_entries(run)))[0]


def invalid_exclusions(run: RunDir) -> list[object]:
    """The names in force that fail the node-name check: left out of every submission."""
    return split(e["node"] for e in active(read_entries(run)))[1]


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
    """Exclude `nodes` from now on; a name that is no node name is left out, with a warning."""
    nodes, invalid = split(nodes)
    if invalid:
        print(warning(invalid, source=f"the nodes to exclude from {run.path.name} ({reason})"), file=sys.stderr,
              flush=True)
    with _locked(run) as entries:
        known = {e["node"] for e in active(entries)}
        entries += [{"node": n, "job_id": job_id, "reason": reason, "time": round(time.time(), 3)}
                    for n in nodes if n not in known]


def readmit(run: RunDir, node: str, *, by: str, reason: str) -> dict:
    """Give `node` back to the run; the entry it had, now with `readmitted`. A node the
    run does not exclude is a UserError naming the ones it does."""
    check_node(node, flag="--readmit")
    with _locked(run) as entries:
        current = [e for e in active(entries) if e["node"] == node]
        if not current:
            now = sorted({e["node"] for e in active(entries) if is_node_name(e["node"])})
            raise UserError(f"--readmit {node}: the run does not exclude {node}"
                            f" (excluded now: {', '.join(now) or 'none'})")
        for entry in current:
            entry["readmitted"] = {"by": by, "reason": reason, "time": round(time.time(), 3)}
        return dict(current[-1])


def check_node(node: str, *, flag: str) -> None:
    """A UserError for a name given on the command line that is no node name."""
    if not is_node_name(node):
        raise UserError(f"{flag} {shown(node)}: not a node name (letters, digits, '-', '_', '.' and ranges like"
                        " node[1-3,5]); python -m dtk.nodes RUN_DIR lists the nodes the run excludes")
