"""Errors in the user's own code on real local runs (real workers, gloo, a project folder):

- a bug in a user loss that fails every start alike (a `view` of a non-contiguous tensor)
  ends the run after its second start, with one `error:` line naming the exception and the
  user's file:line, and a `user_code_error` event (the rule: dtk/driver/decide.py;
  its rows against fakes: tests/test_local_driver.py, tests/test_supervisor.py);
- a user data function that fails before the run's first step (a missing file) is a
  configuration error: the first start fails, nothing is relaunched, no advice to resume.

Both also run as lab jobs (Slurm's driver, the same rules; under the lab's lock).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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
LOSS_LINE = 1 + LOSS_PY.splitlines().index("    flat = logits.view(-1)")

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


FLAKY_PY = """\
import os

import numpy as np
import torch.nn.functional as F

calls = 0


def hiccup_in_the_first_start(model, batch):  # the first start dies at its 4th step, the way a machine fault would
    global calls
    calls += 1
    if os.environ["DTK_RESTART"] == "0" and calls > 3:
        raise RuntimeError("the machine hiccuped")
    return F.cross_entropy(model(batch[:, :-1]).transpose(1, 2), batch[:, 1:])


def load(path, broken_once):
    # Rank 0's progress file says the run has trained; the first start itself always reads
    # (on a busy machine rank 1 may load after rank 0 wrote its first progress).
    if os.environ["DTK_RESTART"] != "0" and os.path.exists(broken_once):
        raise OSError(f"cannot read {path}: the storage went away")
    return np.load(path)
"""
FLAKY_LINE = 1 + FLAKY_PY.splitlines().index('        raise OSError(f"cannot read {path}: the storage went away")')


def test_a_data_function_that_fails_after_the_run_trained_is_a_crash_and_its_repeat_stops_the_run(tmp_path):
    """After the run's first step the same failure is no configuration error: a crash,
    relaunched, and the repeat rule ends it after the second start that fails alike."""
    folder = project(tmp_path)
    (folder / "flaky.py").write_text(FLAKY_PY)
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 256, size=(64, 17)))
    runs = tmp_path / "runs"
    proc = dtk("dtk.submit", *JOB, "train.log_every=1", "run.name=r", "data=user", "data._target_=flaky.load",
               f"+data.kwargs.path={tmp_path / 'tokens.npy'}", f"+data.kwargs.broken_once={runs / 'r' / 'progress'}",
               "task._target_=flaky.hiccup_in_the_first_start", "task.form=model", f"run.root={runs}", cwd=folder,
               timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert f"OSError: cannot read {tmp_path / 'tokens.npy'}: the storage went away" in line, line
    assert f"{folder / 'flaky.py'}:{FLAKY_LINE}" in line and "before the run's first step" not in line, line
    run = runs / "r"
    assert len(events(run, "started")) == 3 and len(events(run, "relaunched")) == 2
    (event,) = events(run, "user_code_error")
    assert event["type"] == "OSError" and event["line"] == FLAKY_LINE


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
    assert summary["status"] == "failed" and summary["error"].startswith("the same exception in user code ended two starts")
    (err,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "RuntimeError: view size is not compatible" in err and f"badloss.py:{LOSS_LINE}" in err, err


@pytest.mark.slurm
def test_a_user_data_function_that_fails_before_the_first_step_fails_the_lab_job_at_its_first_start(lab, tmp_path):
    folder = project(tmp_path)
    missing = tmp_path / "missing.npy"
    proc = dtk("dtk.submit", "cluster=lab", "nodes=2", "tasks_per_node=1", *JOB[:-1], "data=user",
               "data._target_=baddata.load", f"+data.kwargs.path={missing}", "submit.wait=true",
               f"run.root={tmp_path / 'runs'}", cwd=folder, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run = only_run_dir(tmp_path / "runs")
    assert len(events(run, "started")) == 1 and events(run, "relaunched") == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("configuration error in job ")
    assert "data._target_=baddata.load failed before the run's first step: FileNotFoundError" in summary["error"]
    (err,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert str(missing) in err and "resume" not in err.lower(), err
