"""Why did a worker step fail? The first error line in the ranks' logs."""

from __future__ import annotations

import re
from pathlib import Path

_ERROR = re.compile(r"^(\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*)$")
_CONFIG_ERROR = re.compile(r"^(\[rank\d+\]:\s*)?(error: .*)$")  # what a worker prints before exit code 2


def _rank_logs(logs: Path) -> list[Path]:
    return sorted(logs.glob("rank_*.log"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))


def _lines(log: Path) -> list[str]:
    try:
        return log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def failure_cause(logs: Path, code: int | None) -> str:
    """`rank 1: RuntimeError: boom` from the last exception line of the first rank whose log
    has one; otherwise how the step ended."""
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
