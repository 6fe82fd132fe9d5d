"""The local driver's relaunch lines against dtk.status on a real run restored from memory:
a killed worker, a relaunch from the in-memory snapshot (no checkpoint on disk). The lines
the driver prints, its `relaunched` event and dtk.status agree on the step the relaunched
start resumed from (the fake-time case: tests/test_local_driver.py)."""

from __future__ import annotations

import json
import re

import pytest
from test_memory_tier import kill_one_worker_between_snapshots

from conftest import run_main
from dtk.common.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def test_the_relaunch_after_a_kill_says_the_memory_step_that_dtk_status_shows(tmp_path):
    root, store = tmp_path / "runs", tmp_path / "shm"
    root.mkdir()
    kill_one_worker_between_snapshots(root, store)
    run = RunDir(root / "r")
    (relaunched,) = [e for e in run.events_list() if e["event"] == "relaunched"]
    assert relaunched["resume_from"] is None and relaunched["disk_checkpoint"] == 0  # never the disk step
    log = next(root.glob("driver_*.log")).read_text()
    assert re.search(r"^relaunching \(crashed: worker rank 1 .*\); from the newest in-memory snapshot, else checkpoint"
                     r" step 0 on disk, 0 relaunch\(es\) left$", log, re.M), log
    said = re.findall(r"^resumed from step (\d+) \((\w+)\)$", log, re.M)
    status = run_main("dtk.status", str(run.path), "--json")
    assert status.returncode == 0, status.stderr
    second = json.loads(status.stdout)["starts"][1]
    assert said == [(str(second["resumed_from"]), "memory")] and second["tier"] == "memory", (said, second)
    assert second["resumed_from"] > 0
