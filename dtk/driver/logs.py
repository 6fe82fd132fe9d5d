"""Why did a worker step fail? The first error line in the ranks' logs."""

from __future__ import annotations

import re
from pathlib import Path

_ERROR = re.compile(r"^(\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*)$")


def failure_cause(logs: Path, code: int | None) -> str:
    """`rank 1: RuntimeError: boom` from the last exception line of the first rank whose log
    has one; otherwise how the step ended."""
    for log in sorted(logs.glob("rank_*.log"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0)):
        lines = log.read_text(errors="replace").splitlines()
        errors = [m.group(2) for m in (_ERROR.match(ln.strip()) for ln in lines) if m]
        if errors:
            return f"{log.stem.replace('_', ' ')}: {errors[-1][:300]}"
    if code is not None and code > 128:
        return f"a worker was killed (exit code {code}: signal {code - 128})"
    return f"worker step exited with code {code}"
