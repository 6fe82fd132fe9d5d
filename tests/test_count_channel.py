"""The planner counts a user's `_target_` model in a subprocess (dtk.plan.count_model): its
record travels in a file, not on stdout, so a constructor that prints does not break
planning, and its time limit is a key (`plan.count_timeout_s`) that both dtk.plan and
dtk.submit accept, which its message names.

The model is a project folder's own module (a team's model.py that prints its size, as
many do), used with the folder as the current directory."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import run_main

pytestmark = [pytest.mark.slow]  # each count imports torch in a subprocess

MODEL_PY = """\
import sys
import time

from tests.models_for_tests import build as build_mlp


def build(*, vocab_size, width, depth, expansion=2, seq_len=32, sleep_s=0.0):
    model = build_mlp(vocab_size=vocab_size, width=width, depth=depth, expansion=expansion)
    print(f"number of parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    print("{not json", file=sys.stderr)
    time.sleep(sleep_s)
    return model
"""

MODEL_YAML = "_target_: talky.build\nvocab_size: 256\nseq_len: 32\nwidth: 32\ndepth: 4\nexpansion: 2\n"


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "talky.yaml").write_text(MODEL_YAML)
    (tmp_path / "talky.py").write_text(MODEL_PY)
    return tmp_path


def expected_params() -> int:
    from tests.models_for_tests import build

    return sum(p.numel() for p in build(vocab_size=256, width=32, depth=4, expansion=2).parameters())


def test_a_model_that_prints_is_counted_by_plan_and_submit(project):
    proc = run_main("dtk.plan", "model=talky", "--json", cwd=project)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["params"] == expected_params() and "counted on the meta device" in out["model"]
    # What the constructor printed reached the command's stderr, marked as the model's.
    assert f"model output: number of parameters: {expected_params() / 1e6:.2f}M" in proc.stderr.splitlines(), proc.stderr
    assert "model output: {not json" in proc.stderr.splitlines()

    proc = run_main("dtk.submit", "model=talky", "submit.dry_run=true", f"run.root={project / 'runs'}", cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert "memory not checked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (project / "runs").exists()


def test_submit_plans_the_memory_of_a_model_that_prints_from_its_count(project, monkeypatch):
    from dtk.submit.__main__ import plan_points

    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the project folder goes first on it
    [point] = plan_points(["model=talky", f"run.root={project / 'runs'}"], multirun=False)
    assert point.budget is not None and point.budget.ctx.shape.params == expected_params()


def test_the_count_time_limit_is_a_key_its_message_names_for_each_command(project):
    slow = ["model=talky", "+model.sleep_s=60", "plan.count_timeout_s=0.5"]
    proc = run_main("dtk.submit", *slow, "submit.dry_run=true", f"run.root={project / 'runs'}", cwd=project)
    assert proc.returncode == 0, proc.stderr  # submitted without the memory check, and says so
    (note,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("note: memory not checked")]
    assert "took over plan.count_timeout_s=0.5 s" in note, note
    assert "plan.params" not in note  # a what-if key, which dtk.submit refuses
    suggested = re.findall(r"\((plan\.[a-z_]+=[0-9.]+)\)", note)
    assert suggested == ["plan.count_timeout_s=2"], note
    # What it suggests is a key dtk.submit takes (not refused as a what-if key).
    proc = run_main("dtk.submit", "model=talky", "+model.sleep_s=60", *suggested, "submit.dry_run=true",
                    f"run.root={project / 'runs'}", cwd=project)
    assert proc.returncode == 0 and "error:" not in proc.stderr, proc.stderr

    proc = run_main("dtk.plan", *slow, cwd=project)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: model._target_=talky.build: ") and "plan.count_timeout_s=2)" in line, line


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_count_time_limit_that_is_not_positive_is_refused(project, value):
    proc = run_main("dtk.plan", "model=talky", f"plan.count_timeout_s={value}", cwd=project)
    assert proc.returncode == 2
    assert proc.stderr == f"error: plan.count_timeout_s={float(value)}: expected a positive number of seconds, like 60\n"
