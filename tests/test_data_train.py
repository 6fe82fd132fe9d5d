"""Training on prepared datasets end to end: text and .npy, validation loss, the dataset
version recorded by the run, and the refusal to resume on changed data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, dtk
from dtk.common.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.dist]

JOB = ["train.global_batch=32", "train.micro_batch=8", "model.seq_len=32", "run.name=r", "train.log_every=1000"]


def write_text(path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", ".", "\n"]
    path.write_text(" ".join(rng.choice(words, size=12000)))


def prepare(src, out, *extra) -> str:
    proc = dtk("dtk.data", "prepare", "--input", str(src), "--out", str(out), "--seq-len", "32", *extra)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_text_dataset_trains_evaluates_and_pins_its_version(tmp_path):
    write_text(tmp_path / "a.txt", 0)
    write_text(tmp_path / "b.txt", 1)
    data = tmp_path / "data"
    version = prepare(tmp_path / "a.txt", data)
    job = [*JOB, "data=hdf5", f"data.path={data}", "data.val_fraction=0.1", "train.steps=12",
           "train.eval_every=6", "checkpoint.every=4", f"run.root={tmp_path}",
           "fault.max_restarts=0"]  # the driver stops at the kill (no relaunch)
    run = RunDir(tmp_path / "r")

    # Start, stop after the first checkpoint, change the data under the same path.
    driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", *job], cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(REPO)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(e["event"] == "checkpoint_saved" for e in run.events_list()):
        assert driver.poll() is None and time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.02)
    for pid in (run.path / "logs/start_00/pids").read_text().split():
        os.kill(int(pid), 9)
    driver.wait(timeout=60)
    changed = prepare(tmp_path / "b.txt", data, "--force")
    assert changed != version
    proc = dtk("dtk.submit", *job, cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    assert "data_version" in proc.stderr and "dataset changed" in proc.stderr

    # The same input again is the same version: the run continues.
    assert prepare(tmp_path / "a.txt", data, "--force") == version
    proc = dtk("dtk.submit", *job, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(run.summary.read_text())
    assert summary["status"] == "finished" and summary["data_version"] == version
    manifests = [json.loads(p.read_text()) for p in run.checkpoints.glob("step_*/manifest.json")]
    assert manifests and {m["data_version"] for m in manifests} == {version}
    evals = [json.loads(line) for line in (run.path / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals if e["step"] in (6, 12)][-2:] == [6, 12]
    assert all(np.isfinite(e["val_loss"]) and e["val_samples"] >= 32 for e in evals)
    recs = run.latest_metrics()
    assert sorted(recs) == list(range(1, 13)) and recs[12]["loss"] < recs[1]["loss"]
