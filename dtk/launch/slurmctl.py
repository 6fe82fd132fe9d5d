"""Asking Slurm: partitions, job state, node lists. Parsers are pure; the calls are thin.

Job state comes from squeue and scontrol, not sacct: many clusters (and the lab) run no
accounting database.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from dtk.errors import UserError


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        raise UserError(f"cluster.kind=slurm: `{cmd[0]}` is not on PATH; run on a Slurm login node (or use cluster=local)")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def parse_kv_line(line: str) -> dict[str, str]:
    """`scontrol show ... -o` prints one `Key=Value Key=Value` line per record."""
    out = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


def parse_time_min(text: str) -> float | None:
    """Slurm time (`UNLIMITED`, `30`, `1:00:00`, `2-00:00:00`) in minutes; None for unlimited."""
    if text in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [int(p) for p in text.split(":")]
    if len(parts) == 1:
        minutes = parts[0]
        return days * 1440 + minutes
    if len(parts) == 2:  # MM:SS
        return days * 1440 + parts[0] + parts[1] / 60
    h, m, s = parts[-3:]
    return days * 1440 + h * 60 + m + s / 60


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    total_nodes: int
    max_time_min: float | None
    state: str


def parse_partitions(text: str) -> list[Partition]:
    parts = []
    for line in text.splitlines():
        kv = parse_kv_line(line)
        if "PartitionName" not in kv:
            continue
        parts.append(
            Partition(
                name=kv["PartitionName"],
                default=kv.get("Default") == "YES",
                total_nodes=int(kv.get("TotalNodes", "0")),
                max_time_min=parse_time_min(kv.get("MaxTime", "UNLIMITED")),
                state=kv.get("State", "UP"),
            )
        )
    return parts


def partitions() -> list[Partition]:
    proc = _run(["scontrol", "show", "partition", "-o"])
    if proc.returncode != 0:
        raise UserError(f"cannot ask Slurm for its partitions: {proc.stderr.strip() or proc.stdout.strip()}")
    return parse_partitions(proc.stdout)


def check_fits(parts: list[Partition], *, partition: str | None, nodes: int, time_min: int) -> Partition:
    """The login-node check: a job that could never start is an error now, not a job
    pending forever."""
    names = ", ".join(p.name for p in parts) or "none"
    if partition is None:
        chosen = next((p for p in parts if p.default), None)
        if chosen is None:
            raise UserError(f"cluster.partition is unset and the cluster has no default partition; choose one of: {names}")
    else:
        chosen = next((p for p in parts if p.name == partition), None)
        if chosen is None:
            raise UserError(f"cluster.partition={partition}: no such partition (available: {names})")
    where = f"partition {chosen.name}"
    if nodes > chosen.total_nodes:
        raise UserError(
            f"nodes={nodes}: {where} has only {chosen.total_nodes} node(s); ask for at most {chosen.total_nodes}"
        )
    if chosen.max_time_min is not None and time_min > chosen.max_time_min:
        raise UserError(
            f"cluster.time_min={time_min}: {where} allows at most {chosen.max_time_min:g} minutes per job"
        )
    if not chosen.state.startswith("UP"):
        raise UserError(f"cluster.partition={chosen.name}: the partition is {chosen.state}, not UP")
    return chosen


def job_state(job_id: str) -> str | None:
    """PENDING, RUNNING, COMPLETING, ... while Slurm remembers the job; None once it forgot."""
    proc = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    state = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and state:
        return state[0].strip()
    proc = _run(["scontrol", "show", "job", job_id, "-o"])
    if proc.returncode == 0:
        return parse_kv_line(proc.stdout).get("JobState")
    return None


def expand_nodelist(nodelist: str) -> list[str]:
    proc = _run(["scontrol", "show", "hostnames", nodelist])
    if proc.returncode != 0:
        raise RuntimeError(f"scontrol show hostnames {nodelist}: {proc.stderr.strip()}")
    return proc.stdout.split()
