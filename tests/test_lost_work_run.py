"""Lost work counted exactly on a real run: two gloo workers under the local driver, metrics
written once per train.log_every (larger than the run), a worker SIGKILLed at a known step.
The driver's `relaunched` event, dtk.status's steps redone and the goodput account must
name that step, not the last logging interval's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk
from dtk.common.rundir import RunDir, read_progress
from dtk.report.goodput import account
from dtk.report.runs import load_run
from dtk.report.starts import history

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 40
EVERY = 20
JOB = [
    "tasks_per_node=2", f"train.steps={STEPS}", "train.global_batch=32", "train.micro_batch=8",
    "train.log_every=1000",  # records reach metrics.jsonl only at a checkpoint or the end
    f"checkpoint.every={EVERY}", "checkpoint.async_save=false", "run.name=r", "fault.max_restarts=1",
]


def test_a_worker_killed_at_a_known_step_is_counted_exactly(tmp_path: Path):
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", *JOB, f"run.root={tmp_path}"], cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log, stderr=subprocess.STDOUT)
    run = RunDir(tmp_path / "r")
    try:
        deadline = time.monotonic() + 240
        while True:  # past the checkpoint at 20 and short of the next one
            progress = read_progress(run) if run.path.is_dir() else None
            if progress is not None and progress[1] >= EVERY + 3:
                break
            assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "driver.log").read_text()
            time.sleep(0.005)
        pids = [int((run.log_dir(0) / f"rank_{rank}.pid").read_text().split()[-1]) for rank in (0, 1)]
        for pid in pids:  # freeze both ranks: the step rank 0 reached is the one it dies at
            os.kill(pid, signal.SIGSTOP)
        killed_at = read_progress(run)
        assert killed_at is not None and killed_at[0] == 0
        killed_at_step = killed_at[1]
        os.kill(pids[0], signal.SIGKILL)  # rank 0
        for pid in pids[1:]:
            os.kill(pid, signal.SIGCONT)
        assert driver.wait(timeout=300) == 0, (tmp_path / "driver.log").read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
    assert EVERY < killed_at_step < 2 * EVERY, "the kill missed the window between two checkpoints"

    events = run.events_list()
    relaunched = [e for e in events if e["event"] == "relaunched"]
    assert len(relaunched) == 1 and relaunched[0]["step"] == killed_at_step
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    resumed = loaded[-1]["step"] if loaded else 0
    assert resumed in (0, EVERY)
    # The dead start's newest record is its checkpoint step at most: the old reading.
    dead = [r for r in load_run(run.path).metric_lines if r.get("restart") == 0]
    assert max(r["step"] for r in dead) <= EVERY < killed_at_step

    starts = history(events, load_run(run.path).metric_lines, max_restarts=1)
    assert starts[1]["steps_redone"] == killed_at_step - resumed
    g = account(events, load_run(run.path).metric_lines)
    assert g["redone_steps"] == killed_at_step - resumed and g["parts"]["redone_s"] > 0

    status = dtk("dtk.status", str(run.path), "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["starts"][1]["steps_redone"] == killed_at_step - resumed
