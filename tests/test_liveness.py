"""What the hang timeout measures, on a real local run: a synchronous save longer than
fault.hang_timeout_s is no hang (the heartbeat thread beats while the training thread is
inside it), while a SIGSTOPped rank is still detected within the timeout + 5 s."""

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
