"""One writer per run directory (dtk.launch.runlock): a second launch of a live local or
Slurm job is refused with an error line naming the job; `checkpoint.resume=false` is
refused where the run already holds committed checkpoints. Real processes and files; the
Slurm state is a function here (the lab test drives a real job: tests/test_run_lock_jobs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, dtk
from dtk.common.errors import UserError
from dtk.launch.runlock import RunLock, read_holder

HOLD = """
import sys, time
from pathlib import Path
from dtk.launch.runlock import RunLock
lock = RunLock(Path(sys.argv[1]))
lock.acquire(job_state=None)
lock.record(kind="local", job_id="local-4242")
print("held", flush=True)
time.sleep(60)
"""


def test_a_live_local_holder_is_named_and_its_end_frees_the_run(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError) as exc:
            RunLock(run).acquire(job_state=None)
        message = str(exc.value)
        assert f"run directory {run} is in use by local job local-4242 (dtk.submit pid" in message
        assert f"python -m dtk.status {run}" in message
    finally:
        holder.kill()
        holder.wait()
    with RunLock(run) as lock:  # the kernel dropped the dead holder's lock
        lock.acquire(job_state=None)


@pytest.mark.parametrize("state, refused", [("PENDING", True), ("RUNNING", True), ("REQUEUED", True),
                                            ("COMPLETED", False), ("CANCELLED", False), (None, False)])
def test_a_slurm_holder_holds_the_run_while_slurm_says_it_is_not_ended(tmp_path, state, refused):
    run = tmp_path / "run"
    with RunLock(run) as lock:
        lock.acquire(job_state=None)
        lock.record(kind="slurm", job_id="77")
    asked = []

    def job_state(job):
        asked.append(job)
        return state

    lock = RunLock(run)
    if refused:
        with pytest.raises(UserError, match=rf"in use by Slurm job 77 \({state}\).*python -m dtk.status"):
            lock.acquire(job_state=job_state)
    else:
        lock.acquire(job_state=job_state)
        lock.release()
    assert asked == ["77"] and read_holder(run)["job_id"] == "77"


def test_resume_false_is_refused_where_committed_checkpoints_exist(tmp_path):
    run = tmp_path / "runs" / "mine"
    committed = run / "checkpoints" / "step_00000010"
    committed.mkdir(parents=True)
    (committed / "manifest.json").write_text("{}")
    (run / "checkpoints" / "step_00000020").mkdir()  # a killed save: not committed
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = dtk("dtk.submit", "checkpoint.resume=false", "run.name=mine", f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == (f"error: checkpoint.resume=false: {run} holds committed checkpoints (step 10) that starting over"
                    " would delete; use another run.name to start a new run, or leave checkpoint.resume unset to"
                    " continue this one")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.slow
@pytest.mark.dist
def test_a_second_local_submit_of_a_running_run_is_refused(tmp_path):
    """The first submit holds the run while its workers train; the second is refused naming
    it, and writes nothing: the first finishes with its own checkpoints."""
    args = ["train.steps=400", "train.global_batch=16", "checkpoint.every=100", "train.log_every=100", "run.name=twice",
            f"run.root={tmp_path / 'runs'}"]
    first = subprocess.Popen([sys.executable, "-m", "dtk.submit", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    run = tmp_path / "runs" / "twice"
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        second = dtk("dtk.submit", *args, cwd=tmp_path)
        assert second.returncode == 2, second.stdout + second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith(f"error: run directory {run} is in use by local job local-{first.pid} (dtk.submit pid")
        assert line.endswith(f"Follow it: python -m dtk.status {run}")
        assert first.wait(timeout=300) == 0, first.communicate()
    finally:
        if first.poll() is None:
            first.kill()
    starts = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == "started"]
    assert len(starts) == 1
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step_00000300", "step_00000400"]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_second_submit_of_a_queued_or_running_lab_job_is_refused(lab, tmp_path):
    """The Slurm job id owns the run once it is queued: a second submit is refused naming
    it, and the first job's run is untouched (plan.json, one submission)."""
    args = ["cluster=lab", "nodes=1", "tasks_per_node=1", "train.steps=400", "checkpoint.every=100",
            "run.name=twice", f"run.root={tmp_path / 'runs'}"]
    first = dtk("dtk.submit", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    job = first.stdout.split("submitted job ", 1)[1].split()[0]
    run = tmp_path / "runs" / "twice"
    try:
        plan_before = (run / "plan.json").read_bytes()
        second = dtk("dtk.submit", *args, cwd=tmp_path)
        assert second.returncode == 2, second.stdout + second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith(f"error: run directory {run} is in use by Slurm job {job} (")
        assert line.endswith(f"Follow it: python -m dtk.status {run}")
        assert (run / "plan.json").read_bytes() == plan_before
        submitted = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                     if e["event"] == "submitted"]
        assert [e["job_id"] for e in submitted] == [job]
    finally:
        subprocess.run(["scancel", job], capture_output=True)
