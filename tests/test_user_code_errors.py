"""Errors in the user's own code on real local runs (real workers, gloo, a project folder):

- a bug in a user loss that fails every start alike (a `view` of a non-contiguous tensor)
  ends the run after its second start, with one `error:` line naming the exception and the
  user's file:line, and a `user_code_error` event (the rule: dtk/driver/decide.py;
  its rows against fakes: tests/test_local_driver.py, tests/test_supervisor.py);
- a user data function that fails before the run's first step (a missing file) is a
  configuration error: the first start fails, nothing is relaunched, no advice to resume.

The loss bug also runs as a lab job (Slurm's driver, the same rule; under the lab's lock).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import dtk, only_run_dir

pytestmark = [pytest.mark.slow, pytest.mark.dist]

LOSS_PY = """\
import torch.nn.functional as F


def ce(model, batch):
    logits = model(batch[:, :-1]).transpose(1, 2)  # (batch, vocab, seq): not contiguous
    flat = logits.view(-1)
    return F.cross_entropy(flat.view(logits.shape), batch[:, 1:])
"""
LOSS_LINE = 6  # the `view`

DATA_PY = """\
import numpy as np


def load(path):
    return np.load(path)
"""

JOB = ["train.global_batch=8", "model.seq_len=16", "train.steps=5", "fault.max_restarts=3", "tasks_per_node=2"]


def project(tmp_path: Path) -> Path:
    folder = tmp_path / "proj"
    (folder / "conf").mkdir(parents=True)  # a project folder: its modules are importable
    (folder / "badloss.py").write_text(LOSS_PY)
    (folder / "baddata.py").write_text(DATA_PY)
    return folder


def events(run: Path, name: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == name]


def test_a_bug_in_a_user_loss_fails_the_run_after_its_second_start(tmp_path):
    folder = project(tmp_path)
    proc = dtk("dtk.submit", *JOB, "task._target_=badloss.ce", "task.form=model", f"run.root={tmp_path / 'runs'}", cwd=folder,
               timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "RuntimeError: view size is not compatible with input tensor's size and stride" in line, line
    assert f"{folder / 'badloss.py'}:{LOSS_LINE} (step 0)" in line, line
    assert "again" not in line and "resume" not in line.lower()
    run = only_run_dir(tmp_path / "runs")
    assert len(events(run, "started")) == 2 and len(events(run, "relaunched")) == 1
    (event,) = events(run, "user_code_error")
    assert event["type"] == "RuntimeError" and event["file"] == str(folder / "badloss.py")
    assert event["line"] == LOSS_LINE and event["step"] == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == line.removeprefix("error: ").split("; log ")[0]


def test_a_user_data_function_that_fails_before_the_first_step_is_a_configuration_error(tmp_path):
    folder = project(tmp_path)
    missing = tmp_path / "missing.npy"
    proc = dtk("dtk.submit", *JOB, "data=user", "data._target_=baddata.load", f"+data.kwargs.path={missing}",
               f"run.root={tmp_path / 'runs'}", cwd=folder, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: data._target_=baddata.load failed before the run's first step: FileNotFoundError:")
    assert str(missing) in line and f"{folder / 'baddata.py'}:5" in line, line
    assert "again" not in line and "checkpoint" not in line
    run = only_run_dir(tmp_path / "runs")
    assert len(events(run, "started")) == 1 and events(run, "relaunched") == []
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slurm
def test_a_bug_in_a_user_loss_fails_the_lab_job_after_its_second_start(lab, tmp_path):
    folder = project(tmp_path)
    proc = dtk("dtk.submit", "cluster=lab", "nodes=2", "tasks_per_node=1", *JOB[:-1], "task._target_=badloss.ce",
               "task.form=model", "submit.wait=true", f"run.root={tmp_path / 'runs'}", cwd=folder, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run = only_run_dir(tmp_path / "runs")
    assert len(events(run, "started")) == 2 and len(events(run, "relaunched")) == 1
    (event,) = events(run, "user_code_error")
    assert event["file"] == str(folder / "badloss.py") and event["line"] == LOSS_LINE and event["step"] == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("error in user code, the same at two starts")
    (err,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "RuntimeError: view size is not compatible" in err and f"badloss.py:{LOSS_LINE}" in err, err
