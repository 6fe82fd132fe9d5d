"""Upgrade: a run started under the previous release, killed after a checkpoint, resumes under
this code with the same command - same run directory, from its checkpoint, to the end.

The previous release is built from the repository's own history (tests/releases.py names its
commit; `git archive` of it into a temporary folder), and run as a user would run it.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk, require
from dtk.common.rundir import RunDir
from dtk.config.compose import compose
from dtk.config.identity_v0 import v0_hash
from releases import previous_release

pytestmark = [pytest.mark.slow, pytest.mark.dist]

# No run.name: the name the old release derives is what the new one must find again.
JOB = ["train.steps=60", "train.global_batch=16", "train.log_every=1", "checkpoint.every=5",
       "fault.max_restarts=0", "model.dropout=0.1"]


def build_release(commit: str, into: Path) -> Path:
    """The source tree of `commit`, from this repository's history."""
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    require(found.returncode == 0, f"this clone lacks commit {commit} (a shallow clone); fetch its history")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def committed(run: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*/manifest.json"))


def test_a_run_of_the_previous_release_resumes_under_this_one(tmp_path):
    tag, commit = previous_release()
    old = build_release(commit, tmp_path / tag)
    root = tmp_path / "runs"
    root.mkdir()
    log = open(tmp_path / "old.log", "w")
    driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", *JOB, f"run.root={root}"], cwd=root,
                              env=dict(os.environ, PYTHONPATH=str(old)), stdout=log, stderr=subprocess.STDOUT)
    expected = root / f"transformer-{v0_hash(compose(JOB))}"
    deadline = time.monotonic() + 300
    while not (expected / "checkpoints").is_dir() or not committed(expected):
        assert driver.poll() is None, f"{tag} ended before its first checkpoint: {(tmp_path / 'old.log').read_text()}"
        assert time.monotonic() < deadline, "no checkpoint of the old release in 300 s"
        time.sleep(0.01)
    # Killed as a node loss would: the workers first, then the driver.
    starts = sorted((expected / "logs").glob("start_*"))
    for pid in (starts[-1] / "pids").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=60)
    saved = committed(expected)
    assert saved and saved[-1] < 60, f"{tag} was not stopped mid-run: {saved}"

    done = dtk("dtk.submit", *JOB, f"run.root={root}", cwd=root, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    # The same run directory, no new one (audit/ beside it is the run root's log).
    assert [p for p in root.iterdir() if (p / "plan.json").exists()] == [expected]
    run = RunDir(expected)
    loaded = [e for e in run.events_list() if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["step"] == saved[-1], loaded
    summary = json.loads((expected / "summary.json").read_text())
    assert (summary["status"], summary["final_step"]) == ("finished", 60)
    steps = sorted(run.latest_metrics())
    assert steps == list(range(1, 61))
