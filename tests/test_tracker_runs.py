"""The team's tracker across a run's whole life, for real: an `mlflow server` started here
(SQLite store), W&B in offline mode. A local run whose driver and workers are SIGKILLed
mid-way and then submitted again, and a lab run preempted and requeued, each leave exactly
one MLflow run whose loss history holds every step once; the W&B offline folders of the
local run's two starts hold one run id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk, only_run_dir
from lab_support import job_gone
from mlflow_support import mlflow_server, the_one_run

pytestmark = pytest.mark.slow

STEPS = 40
LOCAL = ["tasks_per_node=2", f"train.steps={STEPS}", "train.global_batch=8", "train.log_every=5",
         "checkpoint.every=10", "checkpoint.async_save=false", "train.tracker=[mlflow,wandb]", "run.name=tracked"]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """One server for the module: it takes tens of seconds to start (its store's migrations)."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def logged_steps(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.dist
def test_a_killed_and_resubmitted_local_run_is_one_tracker_run_with_every_step_once(tmp_path, mlflow_uri):
    env = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": mlflow_uri}
    args = [sys.executable, "-m", "dtk.submit", *LOCAL, f"run.root={tmp_path / 'runs'}"]
    log = open(tmp_path / "first.log", "w")
    driver = subprocess.Popen(args, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PYTHONPATH=str(REPO), **env))
    run = tmp_path / "runs" / "tracked"
    try:  # past the checkpoint at 20, some steps after it logged: those are redone
        wait_for(lambda: max(logged_steps(run), default=0) >= 25 or driver.poll() is not None, 300, "step 25")
        assert driver.poll() is None, (tmp_path / "first.log").read_text()
        workers = [int((run / "logs" / "start_00" / f"rank_{r}.pid").read_text().split()[-1]) for r in (0, 1)]
        for pid in [driver.pid, *workers]:
            os.kill(pid, signal.SIGKILL)
        driver.wait()
        wait_for(lambda: all(gone(pid) for pid in workers), 30, "the workers to die")
    finally:
        if driver.poll() is None:
            driver.kill()
    assert max(logged_steps(run)) < STEPS
    again = dtk("dtk.submit", *LOCAL, f"run.root={tmp_path / 'runs'}", cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert sorted(set(logged_steps(run))) == list(range(1, STEPS + 1))
    assert len(logged_steps(run)) > STEPS, "no step was redone: the kill missed its window"

    run_id, steps = the_one_run(mlflow_uri, run)
    assert steps == {step: 1 for step in range(1, STEPS + 1)}
    state = json.loads((run / "tracker.json").read_text())
    assert state["mlflow"]["run_id"] == run_id and state["mlflow"]["last_step"] == STEPS
    events = [json.loads(line)["event"] for line in (run / "events.jsonl").read_text().splitlines()]
    assert "tracker_unreachable" not in events

    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2, offline  # one per start
    assert {p.name.rsplit("-", 1)[1] for p in offline} == {state["wandb"]["run_id"]}


@pytest.mark.slurm
def test_a_preempted_and_requeued_lab_run_is_one_tracker_run_with_every_step_once(lab, tmp_path, mlflow_uri):
    # The `lab` fixture's nodes share this machine's network stack (no --netns): a job
    # reaches a server on 127.0.0.1. With --netns it would listen on the lab's bridge.
    assert lab.record is not None and not lab.record.netns
    steps, uri = 120, mlflow_uri
    proc = dtk("dtk.submit", "cluster=lab", "nodes=2", "tasks_per_node=1", f"train.steps={steps}",
               "train.global_batch=32", "checkpoint.every=20", "train.log_every=10", "train.tracker=[mlflow]",
               f"train.mlflow_uri={uri}", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.split("submitted job ", 1)[1].split()[0]
    run = only_run_dir(tmp_path)
    try:
        wait_for(lambda: max(logged_steps(run), default=0) >= 40, 180, "step 40")
        drill = dtk("dtk.drill", "preempt", str(run), "--hold", "5")
        assert drill.returncode == 0, drill.stdout + drill.stderr
        wait_for(lambda: (run / "summary.json").exists() and job_gone(job), 300, f"job {job} to end")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished", summary
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("requeued") == 1
    run_id, history = the_one_run(uri, run)
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(tracking_uri=uri).get_run(run_id).data.tags
    assert history == {step: 1 for step in range(1, steps + 1)}
    assert tags["dtk.job_ids"] == job


def test_a_run_whose_mlflow_is_unreachable_finishes_with_one_event(tmp_path):
    from mlflow_support import free_port

    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = dtk("dtk.submit", "tasks_per_node=1", "train.steps=4", "train.global_batch=4", "train.log_every=1",
               "train.tracker=[mlflow]", f"train.mlflow_uri={closed}", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = [json.loads(line) for line in (only_run_dir(tmp_path) / "events.jsonl").read_text().splitlines()]
    unreachable = [e for e in events if e["event"].startswith("tracker_")]
    assert [(e["event"], e["tracker"]) for e in unreachable] == [("tracker_unreachable", "mlflow")], unreachable
    assert json.loads((only_run_dir(tmp_path) / "summary.json").read_text())["status"] == "finished"
