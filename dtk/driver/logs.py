"""Why did a worker step fail? The first error line in the ranks' logs."""

from __future__ import annotations

import re
from pathlib import Path

_ERROR = re.compile(r"^(\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*)$")
_CONFIG_ERROR = re.compile(r"^(\[rank\d+\]:\s*)?(error: .*)$")  # what a worker prints before exit code 2
# srun's own report of a task that ended badly: `srun: error: node3: task 1: Killed`,
# `srun: error: node2: tasks 0-1: Exited with exit code 1`. With --kill-on-bad-exit the first
# such line is the task that died; the lines after it are the tasks srun then ended.
_SRUN_TASK = re.compile(r"srun: error: (\S+): tasks? (\d+)[\d,\-]*: (.+)$")
SRUN_LOG = "srun.log"


def _rank_logs(logs: Path) -> list[Path]:
    return sorted(logs.glob("rank_*.log"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))


def _lines(log: Path) -> list[str]:
    try:
        return log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def first_dead_task(srun_log: Path) -> tuple[int, str, str] | None:
    """(rank, host, how) of the first task srun reported ending badly, or None."""
    for line in _lines(srun_log):
        m = _SRUN_TASK.search(line.strip())
        if m:
            return int(m.group(2)), m.group(1), m.group(3).strip()
    return None


def failure_cause(logs: Path, code: int | None) -> str:
    """Why the step failed. Where srun reported the first task that died (logs/srun.log), that
    rank, its host and its own log's last error (or last line); the other ranks' errors
    (a peer's collective reset, a SIGTERM) are consequences and are labelled so. Otherwise
    `rank 1: RuntimeError: boom` from the first rank whose log has an exception line, or how
    the step ended."""
    first = first_dead_task(logs / SRUN_LOG)
    if first is not None:
        rank, host, how = first
        log = logs / f"rank_{rank}.log"
        errors = [m.group(2) for m in (_ERROR.match(ln.strip()) for ln in _lines(log)) if m]
        said = errors[-1] if errors else last_line(log)
        return (f"rank {rank} on {host} died first ({how}); its log ends: {said[:300] or '(empty)'}"
                "; the other ranks' errors are consequences")
    for log in _rank_logs(logs):
        errors = [m.group(2) for m in (_ERROR.match(ln.strip()) for ln in _lines(log)) if m]
        if errors:
            return f"{log.stem.replace('_', ' ')}: {errors[-1][:300]}"
    if code is not None and code > 128:
        return f"a worker was killed (exit code {code}: signal {code - 128})"
    return f"worker step exited with code {code}"


def error_line(log: Path) -> str | None:
    """The last `error: ...` line a worker printed to this log before exit code 2."""
    found = [m.group(2) for m in (_CONFIG_ERROR.match(ln.strip()) for ln in _lines(log)) if m]
    return found[-1][:500] if found else None


def config_error_line(logs: Path) -> str | None:
    """`rank 0: error: data.path=...: ...`: the `error:` line of the first rank that
    stopped on a configuration error (dtk.worker.codes.EXIT_CONFIG), or None."""
    for log in _rank_logs(logs):
        line = error_line(log)
        if line:
            return f"{log.stem.replace('_', ' ')}: {line}"
    return None


def last_line(log: Path) -> str:
    """The last non-empty line a worker wrote (what it was doing when it died)."""
    lines = [ln.strip() for ln in _lines(log) if ln.strip()]
    return lines[-1][:300] if lines else ""
