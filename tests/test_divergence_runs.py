"""Divergence end to end (local cluster, real gloo workers): `dtk.drill nan` makes three
losses in a row NaN, the run skips them, rolls back to its checkpoint, skips their data
window and finishes with finite losses, and a second run with the same drill gives the same
losses bit for bit; a user model's one huge loss is a skipped update, not a poisoned model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk
from dtk.common.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.dist]

JOB = ["train.steps=12", "train.global_batch=8", "train.micro_batch=4", "tasks_per_node=2", "checkpoint.every=2",
       "train.log_every=1000", "run.name=d", "fault.max_restarts=0"]


def drilled_run(root: Path) -> RunDir:
    """A run whose losses of steps 5-7 are NaN: the drill's request lands as soon as the run
    directory exists, long before the workers (seconds of imports) reach step 5."""
    root.mkdir()
    log = open(root / "driver.log", "w")
    driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", *JOB, f"run.root={root / 'runs'}"], cwd=root,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log, stderr=subprocess.STDOUT)
    run = RunDir(root / "runs" / "d")
    deadline = time.monotonic() + 120
    while not run.plan_json.is_file():
        assert driver.poll() is None and time.monotonic() < deadline, (root / "driver.log").read_text()
        time.sleep(0.01)
    drill = dtk("dtk.drill", "nan", str(run.path), "--at-step", "5", "--steps", "3")
    assert drill.returncode == 0, drill.stderr
    assert driver.wait(timeout=300) == 0, (root / "driver.log").read_text()
    return run


def test_drill_nan_rolls_back_skips_the_window_and_reruns_bit_for_bit(tmp_path):
    run = drilled_run(tmp_path / "a")
    events = run.events_list()
    skipped = [e for e in events if e["event"] == "skipped_update"]
    assert [(e["step"], e["cause"]) for e in skipped] == [(5, "nonfinite_loss"), (6, "nonfinite_loss"),
                                                           (7, "nonfinite_loss")]
    (rolled,) = [e for e in events if e["event"] == "rolled_back"]
    assert rolled["to_step"] == 4 and rolled["data_window"] == [4, 6]
    assert rolled["batch_hashes"] == [e["batch_hash"] for e in skipped]
    skips = json.loads((run.path / "data_skips.json").read_text())
    assert [(s["from_step"], s["num_steps"], s["checkpoint_step"]) for s in skips] == [(5, 3, 4)]
    records = run.latest_metrics()
    assert sorted(records) == list(range(1, 13))
    assert all(math.isfinite(r["loss"]) and "skipped" not in r for r in records.values())
    # Step 5 after the rollback reads the batch after the window, none of the skipped ones.
    every = [json.loads(ln) for ln in run.metrics.read_text().splitlines()]
    assert records[5]["batch_hash"] not in {e["batch_hash"] for e in skipped}
    assert any(r["step"] == 5 and r.get("skipped") for r in every)  # the skipped record, superseded
    status = dtk("dtk.status", str(run.path))
    assert status.returncode == 0 and "rolled back: bad steps 5-7" in status.stdout and "3 skipped update(s)" in status.stdout, status.stdout
    report = dtk("dtk.report", str(run.path), "--no-plots")
    assert report.returncode == 0 and "divergence   3 update(s) skipped, 1 rollback(s)" in report.stdout, report.stdout
    assert sorted(int(p.name.split("_")[1]) for p in run.checkpoints.iterdir()) == [10, 12]  # keep=2

    again = drilled_run(tmp_path / "b")
    assert [r["loss"] for _, r in sorted(again.latest_metrics().items())] == \
           [r["loss"] for _, r in sorted(records.items())]
    assert json.loads((again.path / "data_skips.json").read_text()) == skips


MODEL_YAML = """\
_target_: tests.models_for_tests.build_spike
vocab_size: 256
seq_len: 32
width: 32
depth: 2
spike_at: 5
"""


def test_a_huge_loss_on_one_batch_is_a_skipped_update(tmp_path):
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "spike.yaml").write_text(MODEL_YAML)
    proc = dtk("dtk.submit", f"hydra.searchpath=[file://{conf}]", "model=spike", "tasks_per_node=1",
               "train.steps=10", "train.global_batch=4", "train.micro_batch=4", "fault.spike_window=3",
               "train.log_every=1000", "run.name=s", f"run.root={tmp_path / 'runs'}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = RunDir(tmp_path / "runs" / "s")
    events = run.events_list()
    (skipped,) = [e for e in events if e["event"] == "skipped_update"]
    assert skipped["step"] == 6 and skipped["cause"] == "spike" and skipped["loss"] > 1000
    assert not [e for e in events if e["event"] == "rolled_back"]
    records = run.latest_metrics()
    assert records[6].get("skipped") == "spike"
    later = [records[s]["loss"] for s in range(7, 11)]
    assert all(math.isfinite(v) and v < 10 for v in later), later  # the model was not poisoned
