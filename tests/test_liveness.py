"""What the hang timeout measures, on real local runs (docs/recovery.md, Liveness): a
synchronous save longer than fault.hang_timeout_s is no hang (the heartbeat thread beats
while the training thread is inside it), while a SIGSTOPped rank is still detected within
the timeout + 5 s; a step of several micro-batches lasting 3 x the timeout is progress
micro-batch by micro-batch, and a resume whose checkpoint load outlasts
fault.startup_timeout_s is not killed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_spine import _events, _rank_pid, _wait

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.dist]

TIMEOUT_S = 4
SAVE_S = 3 * TIMEOUT_S  # the commit of every save is held this long on rank 0 (a test hook)


def test_a_save_longer_than_the_hang_timeout_is_no_hang_but_a_stopped_rank_is(tmp_path):
    cmd = [sys.executable, "-m", "dtk.submit", "train.steps=400", "checkpoint.every=10", "checkpoint.async_save=false",
           "train.log_every=10", f"fault.hang_timeout_s={TIMEOUT_S}", "fault.max_restarts=0", f"run.root={tmp_path}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), DTK_TEST_COMMIT_DELAY_S=str(SAVE_S))
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped: list[int] = []
    try:
        root = tmp_path
        run = _wait("the run directory", lambda: next((p for p in root.iterdir() if (p / "plan.json").exists()), None),
                    driver)
        saved = _wait("a synchronous save committed", lambda: _events(run, "checkpoint_saved"), driver, timeout=180)
        assert saved[0]["step"] == 10
        # Held SAVE_S > TIMEOUT_S inside the save: no hang verdict, and training went on.
        _wait("a step after the slow save", lambda: max(_steps(run), default=0) > 10, driver, timeout=180)
        assert not _events(run, "hang_detected")
        stopped_at = time.time()
        stopped.append(_rank_pid(run, 0, 1, driver))
        os.kill(stopped[0], signal.SIGSTOP)  # alive and silent: a hang
        (hang,) = _wait("the hang verdict", lambda: _events(run, "hang_detected"), driver, timeout=60)
        assert hang["time"] - stopped_at <= TIMEOUT_S + 5, hang
        driver.communicate(timeout=60)  # max_restarts=0: the driver ends the workers and fails the run
        assert driver.returncode != 0
    finally:
        for pid in stopped:  # a stopped process does not act on its parent's death signal
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if driver.poll() is None:
            driver.kill()
            driver.communicate(timeout=60)


def _steps(run) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


SLOW_MODEL = """\
_target_: tests.models_for_tests.build_slow
vocab_size: 256
seq_len: 16
width: 16
depth: 2
sleep_s: {sleep_s}
wrap_classes: [ResidualMLP]
"""
SLOW_TIMEOUT_S = 3
MICRO_S = 1.5  # each forward; 6 micro-batches make a step of 9 s, 3 x the hang timeout
STARTUP_S = 40
LOAD_S = STARTUP_S + 10  # the resume's checkpoint load outlasts the startup timeout (a test hook)


def test_long_steps_and_a_long_resume_load_are_no_hang(tmp_path):
    """A step of 6 micro-batches, 3 x fault.hang_timeout_s, ticks per micro-batch; rank 0
    killed after the first checkpoint is relaunched, and its start loads for longer than
    fault.startup_timeout_s (the heartbeat beats through the load): no hang verdict, and
    the run finishes from the resumed checkpoint."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "slow.yaml").write_text(SLOW_MODEL.format(sleep_s=MICRO_S))
    cmd = [sys.executable, "-m", "dtk.submit", f"hydra.searchpath=[file://{conf}]", "model=slow", "tasks_per_node=1",
           "train.steps=2", "train.global_batch=6", "train.micro_batch=1", "checkpoint.every=1", "train.log_every=1",
           f"fault.hang_timeout_s={SLOW_TIMEOUT_S}", f"fault.startup_timeout_s={STARTUP_S}", "fault.max_restarts=1",
           f"run.root={tmp_path / 'runs'}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), DTK_TEST_LOAD_DELAY_S=str(LOAD_S))
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        root = tmp_path / "runs"
        run = _wait("the run directory", lambda: root.exists() and next(
            (p for p in root.iterdir() if (p / "plan.json").exists()), None), driver)
        _wait("the first checkpoint", lambda: _events(run, "checkpoint_saved"), driver, timeout=240)
        assert _steps(run) == [1]  # a step of 9 s went by on a hang timeout of 3 s
        os.kill(_rank_pid(run, 0, 0, driver), signal.SIGKILL)
        out, err = driver.communicate(timeout=300)
        assert driver.returncode == 0, out + err
        assert not _events(run, "hang_detected")
        (loaded,) = _events(run, "checkpoint_loaded")
        assert loaded["step"] == 1
        assert loaded["seconds"] >= LOAD_S > STARTUP_S  # the load alone outlasted the startup timeout
        assert max(_steps(run)) == 2
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate(timeout=60)
