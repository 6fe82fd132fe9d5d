"""Shared test helpers: run dtk's real commands, and skip-or-fail for missing capabilities."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"


def require(condition: bool, reason: str) -> None:
    """Skip when the machine cannot run a test; under CI=true that is a failure instead,
    so CI never passes by skipping."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI cannot run this test: {reason}")
    pytest.skip(reason)


def dtk(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m <args>` as a user would (`dtk("dtk.submit", "nodes=1")`); a first
    argument starting with `-` is an interpreter flag (`dtk("-X", "importtime", "-m", ...)`)."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    argv = [sys.executable, *args] if args[0].startswith("-") else [sys.executable, "-m", *args]
    return subprocess.run(
        argv,
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def losses(run_dir: Path) -> dict[int, float]:
    """Per step, the latest logged loss (a step redone after a restart replaces the earlier one)."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def only_run_dir(root: Path) -> Path:
    runs = [p for p in root.iterdir() if p.is_dir()]
    assert len(runs) == 1, f"expected one run directory in {root}, found {runs}"
    return runs[0]


@pytest.fixture(scope="session")
def lab():
    """The lab Slurm cluster with 3 nodes, up for the session and down at its end (if this
    session brought it up)."""
    import lab_support
    from dtk import lab as dtk_lab

    was_up = lab_support.unavailable_reason() is None and dtk_lab.status().up
    status = lab_support.ensure_lab(3)
    yield status
    if not was_up:
        lab_support.lab_down()
