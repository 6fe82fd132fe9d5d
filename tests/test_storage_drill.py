"""The storage drill on a live local run (`python -m dtk.drill storage`, root): the run's
checkpoint folder turns read-only for real while 2 workers train. Training goes on through
the failed saves (`checkpoint_failed`), the first save after the storage is back commits,
and a resume from that checkpoint ends bitwise equal to the uninterrupted run. With the
storage gone for checkpoint.max_failures saves, the run stops with one error line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk, losses, require

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 300
TRAIN = ["tasks_per_node=2", "train.global_batch=32", f"train.steps={STEPS}", "checkpoint.every=10",
         "checkpoint.keep=100", "train.log_every=100", "run.name=drilled"]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    root = tmp_path_factory.mktemp("reference")
    proc = dtk("dtk.submit", *TRAIN, f"run.root={root}", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return losses(root / "drilled")


def named(run: Path, name: str) -> list[dict]:
    if not (run / "events.jsonl").exists():
        return []
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == name]


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert proc.poll() is None, f"the run ended while waiting for {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def drilled_run(root: Path, *extra: str, failures: int) -> tuple[subprocess.Popen, str, Path, list[dict]]:
    """Start the run, drill its storage once a checkpoint committed, give the storage back
    after `failures` failed saves (or when the run ended). Returns the finished run and its stderr."""
    run = root / "drilled"
    proc = subprocess.Popen([sys.executable, "-m", "dtk.submit", *TRAIN, *extra, f"run.root={root}"], cwd=root,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    drill = None
    try:
        wait_for(lambda: named(run, "checkpoint_saved"), "a first checkpoint", proc)
        drill = subprocess.Popen([sys.executable, "-m", "dtk.drill", "storage", str(run), "--hold", "300"],
                                 env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert drill.stdout.readline().endswith("is read-only for 300 s\n")
        deadline = time.monotonic() + 240
        while len(named(run, "checkpoint_failed")) < failures and proc.poll() is None:
            assert time.monotonic() < deadline, "timed out waiting for failed saves"
            time.sleep(0.05)
    finally:
        if drill is not None:
            drill.send_signal(signal.SIGTERM)  # the drill restores the storage and ends
            out, err = drill.communicate(timeout=60)
            assert drill.returncode == 0 and "is writable again" in out, out + err
        _, err = proc.communicate(timeout=600)
    return proc, err, run, named(run, "checkpoint_failed")


def test_training_goes_on_through_failed_saves_and_resumes_bitwise_from_the_next_one(tmp_path, reference):
    require(os.geteuid() == 0, "the storage drill needs root")
    proc, err, run, failed = drilled_run(tmp_path, "checkpoint.max_failures=1000", failures=2)
    assert proc.returncode == 0, err
    assert len(failed) >= 2 and all("Read-only file system" in e["reason"] for e in failed), failed
    first_failed = failed[0]["step"]
    saved = [e["step"] for e in named(run, "checkpoint_saved")]
    after = min(s for s in saved if s > failed[-1]["step"])  # the first save once the storage was back
    assert all(s % 10 == 0 for s in saved) and first_failed not in saved
    assert losses(run) == reference  # training was never interrupted
    # Resume from the first checkpoint after the storage returned: the same losses, bitwise.
    for step, path in ((int(p.name[5:]), p) for p in (run / "checkpoints").iterdir()):
        if step > after:
            shutil.rmtree(path)
    (run / "summary.json").unlink()
    again = dtk("dtk.submit", *TRAIN, "checkpoint.max_failures=1000", f"run.root={tmp_path}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert named(run, "checkpoint_loaded")[-1]["step"] == after
    assert losses(run) == reference


def test_storage_gone_for_max_failures_saves_stops_the_run_with_one_error_line(tmp_path):
    require(os.geteuid() == 0, "the storage drill needs root")
    proc, err, run, failed = drilled_run(tmp_path, "checkpoint.max_failures=2", failures=99)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2, err
    assert len(errors) == 1 and "checkpoint.max_failures=2: 2 saves in a row failed" in errors[0], err
    assert "Read-only file system" in errors[0] and "is intact" in errors[0]
    assert len(failed) == 2
    verified = [p for p in (run / "checkpoints").iterdir() if (p / "manifest.json").exists()]
    assert verified and json.loads((run / "summary.json").read_text())["status"] == "failed"
