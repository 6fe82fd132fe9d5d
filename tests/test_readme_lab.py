"""The README's lab example, followed after its quick start: the lab line starts a run of its
own (its run.name), and the same line without it says the run has finished and how to start
another, instead of silently submitting nothing. The commands are read from the README."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from test_docs_commands import code_lines

from conftest import REPO, dtk, run_dirs

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SHORT = ["train.steps=20"]  # the same on both commands: the same config stays the same run


def readme_command(pattern: str) -> list[str]:
    for line in code_lines((REPO / "README.md").read_text()):
        m = re.search(r"python -m (dtk\.submit\b.*)", line)
        if m and re.search(pattern, line):
            return shlex.split(m.group(1))
    raise AssertionError(f"no README line matches {pattern}")


def test_the_readme_lab_example_after_the_quick_start_gets_a_run_of_its_own(lab, tmp_path):
    quick = readme_command(r"dtk\.submit$")
    lab_line = readme_command(r"cluster=lab nodes=2")
    assert any(arg.startswith("run.name=") for arg in lab_line), lab_line
    root = [f"run.root={tmp_path}"]
    proc = dtk(*quick, *SHORT, *root, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (first,) = run_dirs(tmp_path)

    # Without its run.name the lab line is the quick start's run: it says so, by name, and how to get another.
    same = [a for a in lab_line if not a.startswith("run.name=")]
    proc = dtk(*same, *SHORT, *root, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"run {first.name} already finished" in proc.stdout and "run.name=" in proc.stdout, proc.stdout
    assert "submitted job" not in proc.stdout

    proc = dtk(*lab_line, *SHORT, *root, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    name = next(a.split("=", 1)[1] for a in lab_line if a.startswith("run.name="))
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["status"] == "finished" and "submitted job" in proc.stdout
