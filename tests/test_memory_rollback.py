"""A crash after a rollback, with the in-memory tier on (two gloo workers, local driver):
`dtk.drill nan` makes the losses of steps 11-13 NaN, the run rolls back to its disk
checkpoint of step 8 and goes on; rank 1 is SIGKILLed while the new trajectory is between
steps 9 and 11, when the abandoned trajectory's snapshots of steps 10 and 12 would still be
the newest in the store. The relaunch restores the new trajectory (its snapshot of step 10,
or the disk's 8), never a step it has not reached, and every loss equals the run's without
the crash. While frozen, the store's files are 0600 in 0700 folders."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk
from dtk.common.rundir import MEMORY_STORE_ENV, RunDir, memory_store, read_progress

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 20
JOB = [
    "tasks_per_node=2", f"train.steps={STEPS}", "train.global_batch=32", "train.micro_batch=8", "model.dropout=0.1",
    "train.log_every=1", "checkpoint.every=4", "checkpoint.async_save=false", "checkpoint.memory_every=2",
    "run.name=r", "fault.max_restarts=1",
]


def drilled(root: Path, store: Path) -> tuple[subprocess.Popen, RunDir]:
    """Start the job; the NaN request lands as soon as the run directory exists, long before
    the workers (seconds of imports) reach step 11."""
    root.mkdir(exist_ok=True)
    log = open(root / "driver.log", "w")
    driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", *JOB, f"run.root={root}"], cwd=root,
                              env=dict(os.environ, PYTHONPATH=str(REPO), **{MEMORY_STORE_ENV: str(store)}),
                              stdout=log, stderr=subprocess.STDOUT)
    run = RunDir(root / "r")
    deadline = time.monotonic() + 120
    while not run.plan_json.is_file():
        assert driver.poll() is None and time.monotonic() < deadline, (root / "driver.log").read_text()
        time.sleep(0.01)
    drill = dtk("dtk.drill", "nan", str(run.path), "--at-step", "11", "--steps", "3")
    assert drill.returncode == 0, drill.stderr
    return driver, run


def losses(run: RunDir) -> dict[int, float]:
    return {s: r["loss"] for s, r in run.latest_metrics().items()}


def rolled_back(run: RunDir) -> bool:
    return any(e["event"] == "rolled_back" for e in run.events_list())


def test_a_crash_after_a_rollback_restores_the_new_trajectory_and_gives_the_losses_without_the_crash(tmp_path, monkeypatch):
    driver, reference_run = drilled(tmp_path / "reference", tmp_path / "shm_ref")
    assert driver.wait(timeout=300) == 0, (tmp_path / "reference" / "driver.log").read_text()
    reference = losses(reference_run)
    (rolled,) = [e for e in reference_run.events_list() if e["event"] == "rolled_back"]
    assert (rolled["step"], rolled["to_step"]) == (11, 8) and sorted(reference) == list(range(1, STEPS + 1))

    store = tmp_path / "shm"
    monkeypatch.setenv(MEMORY_STORE_ENV, str(store))  # memory_store() here reads the workers' root
    driver, run = drilled(tmp_path / "crash", store)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "crash" / "driver.log").read_text()
            time.sleep(0.005)
            progress = read_progress(run) if run.path.is_dir() else None
            if progress is None or not 9 <= progress[1] <= 11 or not rolled_back(run):
                continue
            pids = [int((run.log_dir(0) / f"rank_{rank}.pid").read_text().split()[-1]) for rank in (0, 1)]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            progress = read_progress(run)
            if progress is not None and 9 <= progress[1] <= 11:
                break
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        reached = progress[1]
        tree = memory_store(run.path).parent.parent  # <root>/dtk-<uid>
        modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in [tree, *tree.rglob("*")]
                 if not p.name.startswith(".")}  # a temporary name being written is not yet a file of the store
        os.kill(pids[1], signal.SIGKILL)
        os.kill(pids[0], signal.SIGCONT)
        assert driver.wait(timeout=300) == 0, (tmp_path / "crash" / "driver.log").read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
    files = {p: m for p, m in modes.items() if p.suffix in (".pt", ".crc", ".json")}
    assert files and set(files.values()) == {0o600}, files
    assert set(m for p, m in modes.items() if p not in files) == {0o700}, modes
    events = run.events_list()
    assert len([e for e in events if e["event"] == "rolled_back"]) == 1  # the drill's request is taken once
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    after_crash = loaded[-1]
    # the new trajectory: its snapshot of step 10 (memory) or the rollback's checkpoint of step 8
    # (disk); never a step it had not reached (the abandoned 12)
    assert (after_crash["step"], after_crash["tier"]) in ((10, "memory"), (8, "disk")), loaded
    assert after_crash["step"] <= reached, (after_crash, reached)
    assert losses(run) == reference
    assert not memory_store(run.path).exists(), "a finished run leaves its store behind"
