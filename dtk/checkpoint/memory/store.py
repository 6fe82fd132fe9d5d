"""The in-memory snapshot tier's store and its rules, torch-free (checkpoint.memory_every).

Each node keeps, under `dtk.common.rundir.memory_store(run) / <node>/`:

    step_00000042/
        own_00003.pt        rank 3's snapshot (this node ran rank 3): its local pieces of
                            every tensor, keyed as DCP keys them, and the small state
        own_00003.crc       its CRC32, beside it
        own_00003.json      its layout: each tensor's dtype, global size and the offsets
                            and sizes of the piece it holds (what DCP's metadata says of it)
        replica_00001.pt    rank 1's snapshot and layout, received from rank 1 on another node
        replica_00001.crc
        replica_00001.json
        commit.json         written last, by the node's first rank, once every rank of the
                            world wrote its shard and its replica: the step is complete; it
                            holds every rank's shard CRC and layout CRC, and the generation

Rank r sends its replica to `partner(r)` = (r + ranks_per_node) % world: the same local rank
of the next node, a ring over nodes. One node: no replica (the tier can only restore from
`memory`). Files are written to a temporary name and renamed; files are 0600 and folders
0700 (the root is checked by dtk.checkpoint.memory.root).

The generation is the number of rollbacks of the run (dtk.train.rollback) when the step was
taken. A rollback to step T ends the trajectory after T: its snapshots newer than T are
removed on every node before the disk checkpoints are, and a restore or a prune counts only
the snapshots of the run's current generation, so one that a node kept through the rollback
(a node down at the time) is never restored and never crowds out the new trajectory's.

A restore may run on another world size (a shrink): the layouts say which old shards hold
the pieces a new rank needs; those are read from its node or sent by a rank whose node
holds them (`transfers`), and DCP's planner reshards them (dtk.checkpoint.memory.load).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtk.checkpoint.memory.root import make_dirs, remove_folder

STEP_RE = re.compile(r"^step_(\d{8})$")
COMMIT = "commit.json"
KEEP = 2  # the two newest complete steps


def partner(rank: int, world: int, per_node: int) -> int | None:
    """The rank that holds `rank`'s replica: the same local rank on the next node; None on one node."""
    if world <= per_node:
        return None
    return (rank + per_node) % world


def replica_of(rank: int, world: int, per_node: int) -> int | None:
    """The rank whose replica `rank` holds (the inverse of `partner`)."""
    if world <= per_node:
        return None
    return (rank - per_node) % world


def step_dir(node_store: Path, step: int) -> Path:
    return node_store / f"step_{step:08d}"


def shard_name(kind: str, rank: int) -> str:
    assert kind in ("own", "replica"), kind
    return f"{kind}_{rank:05d}.pt"


def layout_name(kind: str, rank: int) -> str:
    return shard_name(kind, rank)[: -len(".pt")] + ".json"


def write_atomic(path: Path, data: bytes) -> None:
    """Readable by this user only (0600); the temporary name is never followed as a symlink."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def write_shard(node_store: Path, step: int, kind: str, rank: int, data: bytes, crc: int,
                layout: bytes = b"{}") -> None:
    """A shard, its CRC and its layout; the shard last, so a shard that is there has both."""
    folder = step_dir(node_store, step)
    make_dirs(folder)
    write_atomic(folder / layout_name(kind, rank), layout)
    write_atomic((folder / shard_name(kind, rank)).with_suffix(".crc"), f"{crc}\n".encode())
    write_atomic(folder / shard_name(kind, rank), data)


def read_layout(node_store: Path, step: int, kind: str, rank: int) -> bytes:
    return (step_dir(node_store, step) / layout_name(kind, rank)).read_bytes()


def read_shard(node_store: Path, step: int, kind: str, rank: int) -> tuple[bytes, int | None]:
    """The bytes of a shard and the CRC stored beside it (None: no CRC file)."""
    path = step_dir(node_store, step) / shard_name(kind, rank)
    data = path.read_bytes()
    try:
        crc: int | None = int(path.with_suffix(".crc").read_text().strip())
    except (OSError, ValueError):
        crc = None
    return data, crc


def commit_record(step: int, *, world_size: int, identity: dict[str, Any], crcs: list[int],
                  layout_crcs: list[int], generation: int = 0) -> dict[str, Any]:
    return {"step": step, "world_size": world_size, "identity": identity, "crcs": crcs,
            "layout_crcs": layout_crcs, "generation": generation}


def generation_of(record: dict[str, Any]) -> int:
    """A commit record's generation (0 in a record written before rollbacks had one)."""
    return int(record.get("generation", 0))


def parse_commit(text: str) -> dict[str, Any] | None:
    """A commit record, or None when it is not one (torn, edited, another format)."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    ok = (isinstance(record.get("step"), int) and isinstance(record.get("world_size"), int)
          and isinstance(record.get("identity"), dict) and isinstance(record.get("generation", 0), int)
          and all(isinstance(record.get(k), list) and len(record[k]) == record["world_size"]
                  and all(isinstance(c, int) for c in record[k]) for k in ("crcs", "layout_crcs")))
    return record if ok else None


def write_commit(node_store: Path, record: dict[str, Any]) -> None:
    write_atomic(step_dir(node_store, record["step"]) / COMMIT, json.dumps(record, sort_keys=True).encode())


def holdings(node_store: Path) -> dict[int, dict[str, Any]]:
    """What a node's store holds: {step: {"commit": record or None, "own": [ranks], "replica": [ranks]}}."""
    out: dict[int, dict[str, Any]] = {}
    try:
        entries = sorted(node_store.iterdir())
    except OSError:
        return out
    for folder in entries:
        m = STEP_RE.match(folder.name)
        if not m:
            continue
        try:
            commit = parse_commit((folder / COMMIT).read_text())
        except OSError:
            commit = None
        held: dict[str, Any] = {"commit": commit, "own": [], "replica": []}
        for f in folder.iterdir():
            kind, _, rest = f.name.partition("_")
            if kind in ("own", "replica") and rest.endswith(".pt") and rest[:-3].isdigit():
                held[kind].append(int(rest[:-3]))
        held["own"].sort()
        held["replica"].sort()
        out[int(m.group(1))] = held
    return out


def prune(node_store: Path, *, generation: int, keep: int = KEEP) -> None:
    """Keep the `keep` newest complete steps of `generation`; delete older ones, incomplete ones
    below the newest complete, and every step committed in another generation (abandoned)."""
    held = holdings(node_store)
    other = {s for s, h in held.items() if h["commit"] is not None and generation_of(h["commit"]) != generation}
    complete = sorted(s for s, h in held.items() if h["commit"] is not None and s not in other)
    kept = set(complete[-keep:])
    newest = complete[-1] if complete else None
    for step in held:
        if step in other or (step not in kept and (newest is None or step < newest)):
            _remove(step_dir(node_store, step))


def remove_after(node_store: Path, step: int) -> list[int]:
    """Delete every step newer than `step` (a rollback to `step` abandoned them); the removed steps."""
    doomed = sorted(s for s in holdings(node_store) if s > step)
    for s in doomed:
        _remove(step_dir(node_store, s))
    return doomed


def _remove(folder: Path) -> None:
    # Out of the step_NNNNNNNN pattern first, in one rename: no listing sees half a step.
    remove_folder(folder, prefix=".removed")


@dataclass
class Choice:
    """The snapshot step the ranks restore (None: the disk tier), and who reads each old rank's shard."""

    step: int | None
    from_world: int = 0
    """The snapshot's world size (the ranks of its shards); another than now: the restore reshards."""
    sources: dict[int, tuple[int, str]] = field(default_factory=dict)
    """old rank -> (the rank now whose node holds its shard, "own" or "replica" file)."""
    crcs: list[int] = field(default_factory=list)
    layout_crcs: list[int] = field(default_factory=list)
    reason: str | None = None
    """Why the tier is not used (None with step None: there was no snapshot to restore)."""


def choose(reports: list[dict[str, Any]], *, world: int, identity: dict[str, Any], disk_step: int,
           generation: int = 0) -> Choice:
    """The newest step of `generation` whose every shard is on some node and not older than the
    disk checkpoint.

    `reports[r]` is rank r's view of its node's store: {"node": name, "steps": holdings()}.
    The snapshot may be of another world size (a shrink, a growth): every old rank's shard
    must be held by a node of the job now. A step committed in another generation (before a
    rollback) is never chosen, and a node whose folder of a step holds such a commit holds
    none of that step's shards. Pure and deterministic: every rank computes the same choice
    from the same reports."""
    reports = [_of_generation(report, generation) for report in reports]
    commits: dict[int, dict[str, Any]] = {}
    abandoned: set[int] = set()
    for report in reports:
        for step, held in report["steps"].items():
            if held["commit"] is not None:
                commits.setdefault(int(step), held["commit"])
        abandoned |= set(report.get("abandoned", ()))
    if not commits:
        newest = max(abandoned, default=None)
        return Choice(None, reason=None if newest is None else
                      f"the newest snapshot (step {newest}) was taken before a rollback")
    # a snapshot of the disk checkpoint's own step too: the same state, read from memory
    newer = sorted((s for s in commits if s >= disk_step), reverse=True)
    if not newer:
        return Choice(None, reason=f"the newest snapshot (step {max(commits)}) is older than the disk"
                                   f" checkpoint (step {disk_step})")
    reasons = []
    for step in newer:
        record = commits[step]
        changed = sorted(k for k in set(identity) | set(record["identity"])
                         if record["identity"].get(k) != identity.get(k))
        if changed:
            reasons.append(f"step {step}: {', '.join(changed)} changed since the snapshot")
            continue
        sources: dict[int, tuple[int, str]] = {}
        for old in range(record["world_size"]):
            found = _holder(reports, old, step)
            if found is None:
                reasons.append(f"step {step}: rank {old}'s shard is on no node of the job (neither its own nor a"
                               f" replica; snapshot of {record['world_size']} ranks, now {world})")
                break
            sources[old] = found
        else:
            return Choice(step, record["world_size"], sources, list(record["crcs"]), list(record["layout_crcs"]))
    return Choice(None, reason="; ".join(reasons))


def _of_generation(report: dict[str, Any], generation: int) -> dict[str, Any]:
    """A node's report without the steps it committed in another generation (listed as abandoned)."""
    steps, abandoned = {}, []
    for step, held in report["steps"].items():
        if held["commit"] is not None and generation_of(held["commit"]) != generation:
            abandoned.append(int(step))
        else:
            steps[step] = held
    return {**report, "steps": steps, "abandoned": abandoned}


def _holder(reports: list[dict[str, Any]], old: int, step: int) -> tuple[int, str] | None:
    """Who reads old rank `old`'s shard of `step`: the rank of that number now when its node
    holds it, else the lowest rank whose node holds it (its own file, or a replica)."""
    order = ([old] if old < len(reports) else []) + [r for r in range(len(reports)) if r != old]
    for holder in order:
        held = reports[holder]["steps"].get(step)
        if held is None:
            continue
        for kind in ("own", "replica"):
            if old in held[kind]:
                return holder, kind
    return None


def pick(olds: list[int], *, rank: int, sources: dict[int, tuple[int, str]], nodes: list[str]) -> int:
    """Of the old ranks whose shards hold the same piece, the one rank `rank` reads it from:
    its own number (the same layout: one shard has all it needs), else one its node holds,
    else the lowest."""
    if rank in olds:
        return rank
    local = [o for o in olds if nodes[sources[o][0]] == nodes[rank]]
    return min(local or olds)


def transfers(needs: list[list[int]], sources: dict[int, tuple[int, str]],
              nodes: list[str]) -> tuple[list[tuple[int, int, int]], dict[int, str]]:
    """The shards that cross nodes, as (old rank, from rank, to rank) in one order every rank
    walks (so no send waits on a receive that waits on it), and each rank's tier: "memory"
    when every shard it needs is on its node, "peer" when one comes from another node."""
    moves, tiers = [], {}
    for rank, wanted in enumerate(needs):
        tiers[rank] = "memory"
        for old in sorted(set(wanted)):
            holder = sources[old][0]
            if nodes[holder] != nodes[rank]:
                moves.append((old, holder, rank))
                tiers[rank] = "peer"
    return sorted(moves), tiers
