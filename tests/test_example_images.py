"""examples/images end to end: a small CNN on .npy images through a user data function, with
the cross-entropy loss and accuracy metric of the user's module, trained by
`python -m dtk.submit` from the example's folder.

- 2-process DDP matches one process within 1e-5 per step (only the order in which the
  per-sample gradients are summed differs; measured ~1e-7), FSDP on 2 processes too;
- killed (SIGKILL of the workers) and resumed, the loss sequence is bitwise equal;
- validation accuracy rises from the first evaluation to the last;
- changed image files are refused on resume (the dataset's version).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_resume import kill_workers

from conftest import REPO, dtk, losses
from dtk.common.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.dist]

EXAMPLE = REPO / "examples" / "images"
# The example's own defaults (30 steps, evaluation every 10) but for a save every 5 steps.
JOB = ["checkpoint.every=5", "train.log_every=1000"]
LOSS_TOL = 1e-5


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A copy of the example with its data written, as a user would have it."""
    folder = tmp_path_factory.mktemp("images") / "images"
    # Not a data/ or runs/ folder a user may have made in the example itself (conf/data/ is needed).
    top = {"data", "runs"}
    shutil.copytree(EXAMPLE, folder, ignore=lambda d, names: [n for n in names if n == "__pycache__" or (
        Path(d) == EXAMPLE and n in top)])
    proc = subprocess.run([sys.executable, "images.py", "data"], cwd=folder, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return folder


def submit(project: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return dtk("dtk.submit", *JOB, *extra, f"run.name={name}", cwd=project, timeout=300)


@pytest.fixture(scope="module")
def runs(project) -> dict[str, Path]:
    out = {}
    for name, extra in {"one": ["tasks_per_node=1"], "ddp": ["tasks_per_node=2"],
                        "fsdp": ["tasks_per_node=2", "+scheme=fsdp"]}.items():
        proc = submit(project, name, *extra)
        assert proc.returncode == 0, f"{name}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        out[name] = project / "runs" / name
    return out


def test_two_process_ddp_and_fsdp_match_one_process_per_step(runs):
    one = losses(runs["one"])
    assert sorted(one) == list(range(1, 31))
    for scheme in ("ddp", "fsdp"):
        got = losses(runs[scheme])
        worst = max(abs(got[s] - one[s]) for s in one)
        print(f"{scheme} vs one process: worst loss difference {worst:.3g}")
        assert sorted(got) == sorted(one) and worst <= LOSS_TOL


def test_validation_accuracy_rises_and_the_split_is_recorded(runs):
    evals = [json.loads(line) for line in (runs["one"] / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [10, 20, 30]
    print("val_accuracy", [e["val_accuracy"] for e in evals])
    assert evals[-1]["val_accuracy"] > evals[0]["val_accuracy"]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    split = json.loads((runs["one"] / "data.json").read_text())
    assert (split["target"], split["num_train"], split["num_validation"]) == ("images.load", 768, 256)


def test_killed_and_resumed_the_losses_are_bitwise_equal_and_changed_data_is_refused(runs, project):
    run = project / "runs" / "killed"
    log = open(project / "killed_driver.log", "w")
    driver = subprocess.Popen(
        [sys.executable, "-m", "dtk.submit", *JOB, "tasks_per_node=2", "run.name=killed",
         "fault.max_restarts=0"],  # the driver stops at the kill (no relaunch); the next command resumes
        cwd=project, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").exists() or max(RunDir(run).latest_metrics(), default=0) < 12:
        assert driver.poll() is None, "the job ended before step 12"
        assert time.monotonic() < deadline, "timed out waiting for step 12"
        time.sleep(0.02)
    kill_workers(run, driver)

    # Other images under the same file names: the run's checkpoints are refused, nothing trains.
    images_file = project / "data" / "images.npy"
    original = np.load(images_file)
    np.save(images_file, original[::-1].copy())
    proc = submit(project, "killed", "tasks_per_node=2")
    assert proc.returncode != 0
    logs = "".join(p.read_text() for p in run.glob("logs/start_*/rank_0.log"))
    assert "the dataset changed since this run started" in proc.stdout + proc.stderr + logs

    # The same images again: it resumes where it was and ends as the uninterrupted run did.
    np.save(images_file, original)
    proc = submit(project, "killed", "tasks_per_node=2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    loaded = [e for e in RunDir(run).events_list() if e["event"] == "checkpoint_loaded"]
    assert loaded and 10 <= loaded[-1]["step"] < 30  # it did resume part-way
    assert losses(run) == losses(runs["ddp"])
