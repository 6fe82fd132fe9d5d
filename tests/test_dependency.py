"""submit.after=JOB: a dtk job that waits for another Slurm job (sbatch --dependency=afterok)."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from conftest import dtk, only_run_dir
from dtk.common.errors import UserError
from dtk.launch.launch import check_dependencies
from lab_support import job_gone


def test_a_dependency_on_a_job_slurm_does_not_know_is_refused():
    known = {"4711": "RUNNING"}
    check_dependencies("4711", known.get)
    check_dependencies(None, known.get)
    with pytest.raises(UserError, match="submit.after=4711:99: Slurm knows no job 99"):
        check_dependencies("4711:99", known.get)


def squeue(job: str, fmt: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", fmt], capture_output=True, text=True).stdout.strip()


@pytest.mark.slurm
@pytest.mark.slow
def test_the_dtk_job_starts_only_after_the_job_it_waits_for(lab, tmp_path):
    first = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 15"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    job_a = first.stdout.strip()
    proc = dtk("dtk.submit", "cluster=lab", "nodes=1", "tasks_per_node=1", "train.steps=4", "train.global_batch=16",
               f"submit.after={job_a}", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_b = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    try:
        assert squeue(job_b, "%T %r") == "PENDING Dependency"
        deadline = time.monotonic() + 240
        while squeue(job_b, "%T") == "PENDING" and time.monotonic() < deadline:
            time.sleep(0.5)
        # Read job A while Slurm still remembers it (MinJobAge): it ended before B left the queue's wait.
        ended_a = subprocess.run(["scontrol", "show", "job", job_a, "-o"], capture_output=True, text=True).stdout
        while not job_gone(job_b) and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job_a, job_b], capture_output=True)
    run = only_run_dir(tmp_path)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    started = [e["time"] for e in events if e["event"] == "started"]
    assert started and "JobState=COMPLETED" in ended_a
    end_a = re.search(r"EndTime=(\S+)", ended_a).group(1)
    assert time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started[0])) >= end_a
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
