"""A site whose preemption cancels (PreemptMode=CANCEL), on the lab switched to it
(`python -m dtk.lab up --preempt-mode cancel`, and back to REQUEUE afterwards): a real
preemption by `python -m dtk.drill preempt` ends the job, the driver has submitted the run
again as a new job, which resumes from the saved step and finishes it with every step once;
dtk.status lists both jobs (dtk/driver/resubmit.py). The driver's decision alone, on the
answers Slurm gave on the lab, is the fast test first."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from conftest import dtk, only_run_dir

STEPS = 200
LAB = ["cluster=lab", "nodes=2", "tasks_per_node=1", "train.global_batch=32", f"train.steps={STEPS}",
       "checkpoint.every=20", "train.log_every=50"]


class Answers:
    """Slurm's answers as measured on the lab (22.05), for the decision alone."""

    def __init__(self, preempt_time: str, mode: str) -> None:
        self.job = f"JobId=7 JobState=RUNNING PreemptTime={preempt_time} Partition=debug Restarts=0"
        self.partition = f"PartitionName=debug PriorityTier=1 PreemptMode={mode} State=UP"

    def run(self, argv, *, timeout=30.0):
        out = self.job if argv[:3] == ["scontrol", "show", "job"] else self.partition
        return subprocess.CompletedProcess(argv, 0, stdout=out + "\n", stderr="")


def test_only_a_preemption_on_a_partition_that_cancels_is_resubmitted():
    from dtk.driver.resubmit import preempted_cancels
    from dtk.launch.slurmctl import Slurm

    def cancels(preempt_time: str, mode: str) -> bool:
        return preempted_cancels(Slurm(Answers(preempt_time, mode)), "7")  # type: ignore[arg-type]

    assert cancels("2026-12-02T09:46:09", "CANCEL")
    assert not cancels("2026-12-02T09:46:09", "REQUEUE")  # Slurm requeues it: the driver's requeue as before
    assert not cancels("None", "CANCEL")  # not preempted: a time limit, a dtk.stop, a scancel


@pytest.fixture
def cancel_lab(lab):
    from dtk import lab as dtk_lab

    said: list[str] = []
    dtk_lab.up(3, install=False, force=True, preempt_mode="cancel", log=said.append)
    try:
        info = subprocess.run(["scontrol", "show", "partition", "debug", "-o"], capture_output=True, text=True).stdout
        assert "PreemptMode=CANCEL" in info, said
        yield
    finally:  # the other lab tests expect Slurm to requeue a preempted job
        dtk_lab.up(3, install=False, force=True, log=lambda _line: None)
    assert dtk_lab.status().record.preempt_mode == "requeue"


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slurm
@pytest.mark.slow
def test_a_preemption_that_cancels_the_job_resubmits_the_run(cancel_lab, tmp_path):
    proc = dtk("dtk.submit", *LAB, f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = proc.stdout.split("submitted job ", 1)[1].split()[0]
    run = only_run_dir(tmp_path)
    wait_for(lambda: len(logged_steps(run)) >= 30, 120, "step 30")
    drilled = dtk("dtk.drill", "preempt", str(run), "--hold", "5")
    assert drilled.returncode == 0, drilled.stdout + drilled.stderr
    wait_for(lambda: (run / "summary.json").exists(), 180, "the run to end")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished", summary

    (preempted,) = [e for e in events(run) if e["event"] == "preempted"]
    (resubmitted,) = [e for e in events(run) if e["event"] == "resubmitted"]
    assert not [e for e in events(run) if e["event"] == "requeued"]
    second = resubmitted["job_id"]
    assert resubmitted["after_job"] == first != second and resubmitted["step"] == preempted["step"]
    started = [e for e in events(run) if e["event"] == "started"]
    assert [(s["restart"], s["job_id"]) for s in started] == [(0, first), (1, second)]
    resumed = [e for e in events(run) if e["event"] == "resumed"][-1]
    assert resumed["step"] == preempted["step"] and resumed["job_id"] == second
    assert sorted(logged_steps(run)) == list(range(1, STEPS + 1)), "a step was computed twice or lost"
    info = subprocess.run(["scontrol", "show", "job", first, "-o"], capture_output=True, text=True).stdout
    assert "JobState=PENDING" not in info and "Restarts=0" in info, info  # gone, never requeued

    status = dtk("dtk.status", str(run))
    assert f"jobs         {first} -> {second}" in status.stdout, status.stdout
    listed = json.loads(dtk("dtk.status", str(run), "--json").stdout)
    assert listed["job_ids"] == [first, second] and listed["starts"][1]["cause"].startswith("preempted")
