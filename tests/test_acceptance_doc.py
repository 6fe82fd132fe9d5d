"""docs/acceptance.md stays true: its control run, run with the document's own commands,
gives the document's expected figures, and the comparison it describes says `identical`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

DOC = REPO / "docs" / "acceptance.md"


def block(name: str, kind: str = "procedure") -> str:
    text = DOC.read_text()
    return text.split(f"<!-- {kind}: {name} -->", 1)[1].split("<!-- end ", 1)[0]


def commands(name: str) -> list[str]:
    return [line.strip().split("  #", 1)[0].strip() for line in block(name).splitlines()
            if line.startswith("    ") and line.strip()]


def figures() -> dict[str, tuple[str, str]]:
    """{figure: (expected, tolerance)} from the document's table."""
    rows = [line.split("|")[1:4] for line in block("control-run", "figures").splitlines() if line.startswith("| ")]
    return {f.strip(): (e.strip(), t.strip()) for f, e, t in rows[1:] if not set(f.strip()) <= {"-", " "}}


def run_all(lines: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    done = []
    for line in lines:
        argv = line.replace("python -m ", f"{sys.executable} -m ", 1)
        proc = subprocess.run(["bash", "-c", argv], cwd=cwd, capture_output=True, text=True, timeout=900,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, f"{line}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        done.append(proc)
    return done


def test_the_document_has_its_commands_and_figures():
    assert len(commands("control-run")) == 4 and len(commands("compare")) == 3
    table = figures()
    assert set(table) >= {"final loss (step 100)", "loss at step 50", "restarts"}
    for figure in ("final loss (step 100)", "loss at step 50"):
        float(table[figure][0])  # a number, not a placeholder


@pytest.mark.slow
def test_the_control_run_gives_the_expected_figures(tmp_path):
    run_all(commands("control-run"), tmp_path)
    run = tmp_path / "runs" / "control"
    losses = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses[record["step"]] = record["loss"]
    table = figures()
    for figure, step in (("final loss (step 100)", 100), ("loss at step 50", 50)):
        expected, tolerance = table[figure]
        rel = float(re.search(r"relative ([0-9.e-]+)", tolerance).group(1))
        assert losses[step] == pytest.approx(float(expected), rel=rel), figure
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == int(table["restarts"][0])
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["step_00000075", "step_00000100"]
    compared = run_all(commands("compare"), tmp_path)
    assert "identical: bit-for-bit equal losses" in compared[1].stdout
    assert "better" in compared[2].stdout or "same" in compared[2].stdout or "worse" in compared[2].stdout
