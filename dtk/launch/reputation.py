"""Node reputation across the runs of one run root: the one rule for "a suspect node".

A node is suspect under a run root when `cluster.suspect_after` (k) or more of the root's
runs exclude it (their `excluded_nodes.json`, dtk/driver/exclusions.py), counting only a
run's exclusions that are still in force (not given back to that run) and that came after
the node's last readmission to the root (`python -m dtk.nodes RUN_ROOT --readmit NODE`,
kept in RUN_ROOT/READMITTED_NODES). A suspect node is left out of every new submission
under the root (sbatch --exclude, dtk.submit.start), and `python -m dtk.watch` raises
`suspect_node` for it; both ask `suspects` below. k=0 turns the rule off.

Anyone who may write the root may write a run's exclusions, so a name there is counted
only when it passes the one node-name check (dtk/launch/nodenames.py); the others are
never suspect, never excluded, and `invalid_of` lists them for dtk.nodes and dtk.watch.

Stdlib only: `dtk.watch` runs it from cron on a login node.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dtk.common.rundir import (
    EVENTS,
    EXCLUDED_NODES,
    PLAN_JSON,
    READMITTED_NODES,
    READMITTED_NODES_LOCK,
    write_json_atomic,
)
from dtk.launch.nodenames import is_node_name, shown

DEFAULT_AFTER = 2
"""cluster.suspect_after's default (the schema's; tests/test_reputation.py holds them equal),
for a root whose runs' plans do not say."""


def read_json(path: Path, empty: Any) -> Any:
    """The JSON in `path`, or `empty` where it is missing, unreadable or of another type."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return empty
    return value if isinstance(value, type(empty)) else empty


def read_readmitted(root: Path) -> dict[str, dict[str, Any]]:
    """node -> its last readmission to the root ({time, by, reason})."""
    found = read_json(Path(root) / READMITTED_NODES, {})
    return {n: r for n, r in found.items() if is_node_name(n) and isinstance(r, dict)
            and isinstance(r.get("time"), (int, float))}


def counts(entries: Iterable[dict[str, Any]], since: float | None) -> set[str]:
    """The nodes one run's exclusion entries count against: in force, and newer than the
    node's readmission to the root (`since`: node -> time, via `suspects_of`)."""
    return {e["node"] for e in entries if isinstance(e, dict) and is_node_name(e.get("node")) and "readmitted" not in e
            and (since is None or float(e.get("time") or 0) > since)}


def suspects_of(exclusions: Mapping[str, list[dict[str, Any]]], readmitted: Mapping[str, dict[str, Any]], *,
                after: int) -> dict[str, list[str]]:
    """The rule, pure: {run name: its exclusion entries} -> {suspect node: the runs that
    exclude it, sorted}."""
    if after <= 0:
        return {}
    by_node: dict[str, list[str]] = {}
    for name in sorted(exclusions):
        entries = exclusions[name]
        nodes = {e.get("node") for e in entries if isinstance(e, dict)}
        for node in sorted(n for n in nodes if is_node_name(n)):
            since = readmitted.get(node, {}).get("time")
            if node in counts([e for e in entries if e.get("node") == node], since):
                by_node.setdefault(node, []).append(name)
    return {node: names for node, names in sorted(by_node.items()) if len(names) >= after}


def invalid_of(exclusions: Mapping[str, list[dict[str, Any]]]) -> dict[str, list[str]]:
    """{a name in force that fails the node-name check, escaped for printing: the runs
    whose exclusions hold it}; such a name is left out of every submission."""
    found: dict[str, list[str]] = {}
    for name in sorted(exclusions):
        entries = [e for e in exclusions[name] if isinstance(e, dict) and "node" in e and "readmitted" not in e]
        for node in sorted({shown(e["node"]) for e in entries if not is_node_name(e["node"])}):
            found.setdefault(node, []).append(name)
    return found


def run_dirs(root: Path) -> list[Path]:
    """The run directories of a root: folders with an events.jsonl or a plan.json."""
    try:
        children = sorted(Path(root).iterdir())
    except OSError:
        return []
    return [p for p in children if p.is_dir() and ((p / EVENTS).is_file() or (p / PLAN_JSON).is_file())]


def exclusions_under(root: Path) -> dict[str, list[dict[str, Any]]]:
    return {p.name: read_json(p / EXCLUDED_NODES, []) for p in run_dirs(root)}


def threshold(plans: Iterable[dict[str, Any]]) -> int:
    """k for a reader of the whole root (dtk.watch, dtk.nodes RUN_ROOT): the smallest
    cluster.suspect_after any of its runs' plans holds, else DEFAULT_AFTER. A submission
    uses its own config's value."""
    found = [((p.get("config") or {}).get("cluster") or {}).get("suspect_after") for p in plans]
    values = [int(v) for v in found if isinstance(v, int) and not isinstance(v, bool)]
    return min(values) if values else DEFAULT_AFTER


def root_threshold(root: Path) -> int:
    return threshold(read_json(p / PLAN_JSON, {}) for p in run_dirs(root))


def suspects(root: Path, *, after: int | None = None) -> dict[str, list[str]]:
    """The suspect nodes of a run root and the runs that exclude them."""
    k = root_threshold(root) if after is None else after
    return suspects_of(exclusions_under(root), read_readmitted(root), after=k)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[dict[str, Any]]:
    """The readmissions to change in place, written back atomically under a lock."""
    with open(Path(root) / READMITTED_NODES_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            found = read_readmitted(root)
            yield found
            write_json_atomic(Path(root) / READMITTED_NODES, found)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def readmit(root: Path, nodes: Iterable[str], *, by: str, reason: str) -> list[str]:
    """Record the nodes' readmission to the root now: only later exclusions count."""
    nodes = sorted(set(nodes))
    assert all(map(is_node_name, nodes)), "dtk.nodes checks a name before it readmits it"
    with _locked(root) as found:
        for node in nodes:
            found[node] = {"by": by, "reason": reason, "time": round(time.time(), 3)}
    return nodes


def submission_line(nodes: Mapping[str, list[str]], *, root: Path, after: int) -> str:
    """What a submission says, in one line, when it leaves suspect nodes out."""
    said = "; ".join(f"{shown(n)} (excluded by {', '.join(map(shown, runs))})" for n, runs in nodes.items())
    return (f"leaving out {len(nodes)} suspect node(s), each excluded by {after} or more runs under {shown(str(root))}:"
            f" {said}; python -m dtk.nodes {shown(str(root))} --readmit NODE gives one back")


def invalid_line(invalid: Mapping[str, list[str]], *, root: Path) -> str:
    """What a submission says when runs under the root exclude names that are no node names."""
    said = "; ".join(f"{n} (in {', '.join(map(shown, runs))})" for n, runs in invalid.items())
    return (f"warning: ignoring {len(invalid)} invalid node name(s) in the exclusions of runs under"
            f" {shown(str(root))}: {said}; they are no node names, so nothing is left out for them")
