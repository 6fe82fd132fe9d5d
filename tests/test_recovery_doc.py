"""docs/recovery.md's procedures: lists of commands, followed command by command on the lab.

The planned-restart procedure runs here. The node-failure procedure is followed inside the
real node-failure drill of tests/test_faults.py
(test_node_failure_continues_on_the_spare_without_requeue), which is the same run (a spare
node, a node set DOWN): one run shows both the recovery and that the document's commands
work on it, the conditional resume only where the document says it applies.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk, only_run_dir
from lab_support import CONDITIONAL, job_gone, procedure

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_the_procedures_are_lists_of_commands():
    steps = procedure()
    assert len(steps) >= 5
    assert any(c.startswith("python -m dtk.status RUN_DIR") for c, _ in steps)
    assert sum(CONDITIONAL in comment for _, comment in steps) == 1
    assert [c for c, _ in procedure("restart-before")][-1] == "scontrol requeuehold JOB"
    assert "scontrol release JOB" in [c for c, _ in procedure("restart-after")]


def follow(name: str, **values: str) -> None:
    """Run each command of a procedure as written, with the placeholders filled in."""
    for command, _ in procedure(name):
        line = command
        for key, value in values.items():
            line = line.replace(key, value)
        line = re.sub(r"^python -m ", f"{sys.executable} -m ", line)
        done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def events(run: Path, name: str) -> list[dict]:
    if not (run / "events.jsonl").exists():
        return []
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == name]


def last_step(run: Path) -> int:
    if not (run / "metrics.jsonl").exists():
        return 0
    return max((json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()), default=0)


def job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\S+)", out)
    reason = re.search(r"Reason=(\S+)", out)
    return f"{state.group(1) if state else '?'} {reason.group(1) if reason else '?'}"


def test_planned_restart_procedure_saves_holds_and_resumes(lab, tmp_path):
    proc = dtk("dtk.submit", "cluster=lab", "nodes=1", "tasks_per_node=1", "train.global_batch=32", "train.steps=300",
               "checkpoint.every=250", "train.log_every=10", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run = only_run_dir(tmp_path)
    try:
        wait_for(lambda: last_step(run) >= 30, 180, "step 30")
        follow("restart-before", JOB=job, RUN_DIR=str(run))
        wait_for(lambda: job_state(job).startswith("PENDING"), 60, "the job back in the queue")
        saved = [e["step"] for e in events(run, "checkpoint_saved")]
        # Saved on the signal, not at the interval (far off, so a busy machine's late signal is no interval save).
        assert saved and 30 <= saved[-1] < 250, saved
        held_at = saved[-1]
        time.sleep(3)
        assert job_state(job).startswith("PENDING"), job_state(job)  # held: it does not start by itself
        follow("restart-after", JOB=job, RUN_DIR=str(run))
        wait_for(lambda: job_gone(job), 300, f"job {job} to end")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    resumed = events(run, "resumed")
    assert resumed and resumed[-1]["step"] == held_at, resumed
    status = json.loads(dtk("dtk.status", str(run), "--json").stdout)
    assert status["state"] == "finished" and status["step"] == 300, status
