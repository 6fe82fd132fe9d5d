"""Divergence on the lab's real Slurm: `dtk.drill nan` into a submitted job rolls it back and
it finishes with the losses of the same drill on the local cluster, bit for bit (same world
size). A divergence after fault.max_rollbacks fails the run with one line, not relaunched:
on the local cluster's real workers here, and the drivers' decision for Slurm (the worker's
exit 2, not relaunched, not requeued) in tests/test_supervisor.py
(test_a_configuration_error_fails_the_job_at_the_first_start), against a fake clock."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
from test_divergence_runs import JOB, drilled_run
from test_faults import finish, named

from conftest import REPO, dtk
from dtk.common.rundir import RunDir
from dtk.worker.codes import EXIT_CONFIG

pytestmark = [pytest.mark.slow]

LAB = ["cluster=lab", "nodes=2", "tasks_per_node=1", *[j for j in JOB if not j.startswith("tasks_per_node=")]]


def submit_drilled(tmp_path, *extra):
    tmp_path.mkdir(exist_ok=True)
    proc = dtk("dtk.submit", *LAB, *extra, f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.split("submitted job ", 1)[1].split()[0]
    run = tmp_path / "runs" / "d"
    # The job is queued or starting (seconds of imports on its nodes): step 5 is far ahead.
    drill = dtk("dtk.drill", "nan", str(run), "--at-step", "5", "--steps", "3")
    assert drill.returncode == 0, drill.stderr
    return job, run


@pytest.mark.slurm
def test_drill_nan_on_slurm_rolls_back_and_matches_the_local_run(lab, tmp_path):
    job, run = submit_drilled(tmp_path / "lab")
    summary = finish(job, run)
    assert summary["status"] == "finished", summary
    (rolled,) = named(run, "rolled_back")
    assert rolled["to_step"] == 4 and rolled["data_window"] == [4, 6]
    assert len(named(run, "started")) == 1
    lab_losses = {int(json.loads(ln)["step"]): json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").open()}
    assert all(math.isfinite(v) for v in lab_losses.values())
    local = drilled_run(tmp_path / "local")
    assert lab_losses == {s: r["loss"] for s, r in local.latest_metrics().items()}


@pytest.mark.dist
def test_a_divergence_past_max_rollbacks_fails_the_run_once(tmp_path):
    """The drill's NaNs on the local cluster with no rollback allowed: the workers stop with
    one error line and exit 2, and the driver fails the run at its first start."""
    root = tmp_path / "runs"
    job = [*JOB, "fault.max_rollbacks=0", "fault.max_restarts=2"]
    driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", *job, f"run.root={root}"], cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    run = RunDir(root / "d")
    try:
        while not run.plan_json.is_file() and driver.poll() is None:
            time.sleep(0.01)
        drill = dtk("dtk.drill", "nan", str(run.path), "--at-step", "5", "--steps", "3")
        assert drill.returncode == 0, drill.stderr
        out, err = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == EXIT_CONFIG, out + err
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert "the run diverged: bad steps 5 (nonfinite_loss, batch " in summary["error"]
    assert "fault.max_rollbacks=0 reached" in summary["error"]
    assert len(named(run.path, "started")) == 1 and not named(run.path, "relaunched")
    assert not named(run.path, "rolled_back") and len(named(run.path, "diverged")) == 1
