"""Nodes this run will not use again: `excluded_nodes.json` in the run directory.

Every later submission or requeue of the run passes them to sbatch as --exclude. To give a
repaired node back to the run, delete its entry (see docs/recovery.md).
"""

from __future__ import annotations

import json
import time

from dtk.rundir import RunDir, write_json_atomic

FILE = "excluded_nodes.json"


def read_exclusions(run: RunDir) -> list[str]:
    try:
        return [entry["node"] for entry in json.loads((run.path / FILE).read_text())]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def add_exclusions(run: RunDir, nodes: list[str], *, job_id: str, reason: str) -> None:
    path = run.path / FILE
    try:
        entries = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        entries = []
    known = {e["node"] for e in entries}
    entries += [{"node": n, "job_id": job_id, "reason": reason, "time": round(time.time(), 3)}
                for n in nodes if n not in known]
    write_json_atomic(path, entries)
