"""`+sync` runs end to end (real `python -m dtk.submit`, gloo workers, DCP checkpoints):
two identical runs give identical losses, and a run killed between two synchronizations
(its newest checkpoint holds replicas that differ) resumes bit for bit, also between two
fragments' synchronizations (sync.fragments). The same for DDP with PowerSGD
(scheme.grad_compression=powersgd), killed after its warm-up: its error feedback resumes.
On another number of replicas a run continues from the last synchronized parameters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, dtk
from dtk.checkpoint.export import load_model_state, synchronized
from dtk.common.rundir import RunDir
from dtk.models.transformer import build
from dtk.parallel.compression import POWERSGD_WARMUP

pytestmark = [pytest.mark.slow, pytest.mark.dist]

EVERY = 4
JOB = [
    "model.dropout=0.1",  # each rank's random stream every step: a resume must restore it
    "train.global_batch=32",
    "train.micro_batch=8",
    "train.log_every=1000",
    "checkpoint.every=5",  # 5, 10, 15: every save lies between two synchronizations
    "fault.max_restarts=0",  # the driver stops at a kill; the next command resumes
]

SYNC = [f"sync.every={EVERY}", "train.steps=18"]  # the last step is no multiple of 4: it synchronizes too
CASES = {  # name -> overrides, the step to kill after
    "local_sgd": (["+sync=local_sgd", *SYNC, "tasks_per_node=2"], 7),
    "diloco": (["+sync=diloco", *SYNC, "tasks_per_node=2"], 7),
    "diloco_fsdp_inside": (["+sync=diloco", *SYNC, "+scheme=hsdp", "scheme.dp_replicate=2", "tasks_per_node=4"], 7),
    # two fragments: one synchronizes after each even step (0 at 4, 8, ...; 1 at 2, 6, ...), saves at odd ones
    "diloco_fragments": (["+sync=diloco", *SYNC, "sync.fragments=2", "tasks_per_node=2"], 7),
    # PowerSGD compresses after its warm-up (10 steps here, the fewest: the learning rate warms up
    # over 2): killed after the save of step 15, its state is in use
    "powersgd": (["+scheme=ddp", "scheme.grad_compression=powersgd", "train.steps=20", "optim.warmup_steps=2",
                  "tasks_per_node=2"], 16),
}


def job(case: str, root: Path, name: str) -> list[str]:
    return [*CASES[case][0], *JOB, f"run.name={name}", f"run.root={root}"]


def finish(args: list[str], root: Path) -> None:
    proc = dtk("dtk.submit", *args, cwd=root, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def losses(run: Path) -> dict[int, tuple[float, str]]:
    return {s: (r["loss"], r["batch_hash"]) for s, r in RunDir(run).latest_metrics().items()}


def events(run: Path, name: str) -> list[dict]:
    return [e for e in RunDir(run).events_list() if e["event"] == name]


def kill_after(args: list[str], root: Path, run: Path, step: int) -> None:
    """Start the run and SIGKILL its workers once a checkpoint is committed and `step` is logged."""
    with open(root / "driver.log", "w") as log:
        driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", *args], cwd=root, stdout=log,
                                  stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(REPO)))
    deadline = time.monotonic() + 300
    while not (events(run, "checkpoint_saved") and any(s >= step for s in RunDir(run).latest_metrics())):
        assert driver.poll() is None, (root / "driver.log").read_text()
        assert time.monotonic() < deadline, "the run never reached the kill point"
        time.sleep(0.02)
    for pid in (sorted((run / "logs").glob("start_*"))[-1] / "pids").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert driver.wait(timeout=60) == 1


def check_the_finished_run_is_one_model(run: Path, steps: int) -> None:
    """The last step synchronized: every replica's parameters are the synchronized ones, and
    the export is the plain model's state."""
    path = run / "checkpoints" / f"step_{steps:08d}"
    saved = load_model_state(path, json.loads((path / "manifest.json").read_text()))
    synced = synchronized(saved)
    model = build(dropout=0.1).state_dict()
    assert set(synced) == set(model)
    for name, tensor in synced.items():
        assert torch.equal(saved[f"replica0.{name}"], tensor) and torch.equal(saved[f"replica1.{name}"], tensor)
    out = run.parent / f"{run.name}.pt"
    proc = dtk("dtk.checkpoint", "export", str(run), "--out", str(out), cwd=run.parent)
    assert proc.returncode == 0, proc.stderr
    build(dropout=0.1).load_state_dict(torch.load(out))  # strict: every name, no other


@pytest.mark.parametrize("case", list(CASES))
def test_identical_runs_are_identical_and_a_kill_between_syncs_resumes_bitwise(case, tmp_path):
    finish(job(case, tmp_path, "a"), tmp_path)
    finish(job(case, tmp_path, "b"), tmp_path)
    reference = losses(tmp_path / "a")
    steps = 20 if case == "powersgd" else 18
    assert sorted(reference) == list(range(1, steps + 1))
    assert losses(tmp_path / "b") == reference
    if case != "powersgd":
        check_the_finished_run_is_one_model(tmp_path / "a", steps)

    run = tmp_path / "r"
    kill_after(job(case, tmp_path, "r"), tmp_path, run, step=CASES[case][1])
    finish(job(case, tmp_path, "r"), tmp_path)
    loaded = events(run, "checkpoint_loaded")
    if case == "powersgd":
        assert loaded and all(e["step"] > POWERSGD_WARMUP for e in loaded), loaded
    else:  # resumed between two synchronizations (of the model, or of each fragment)
        assert loaded and all(e["step"] % (EVERY // 2 if case == "diloco_fragments" else EVERY) for e in loaded), loaded
    assert losses(run) == reference
    assert not events(run, "sync_replicas_changed")


def replicas(args: list[str], count: int) -> list[str]:
    return [a if not a.startswith("tasks_per_node=") else f"tasks_per_node={count}" for a in args]


def test_another_replica_count_continues_from_the_last_synchronized_parameters(tmp_path):
    """4 -> 2 replicas from a checkpoint at a synchronization: every replica held the
    synchronized parameters, so the first step after the resume has the loss the 4 replicas
    had there (the same parameters on the same global batch). 2 -> 4 between two fragments'
    synchronizations: the replicas' inner steps since the oldest fragment's last
    synchronization are dropped, said in an event and a line; the run ends with one model."""
    at_sync = ["+sync=diloco", "sync.every=4", "train.steps=12", "checkpoint.every=4", "tasks_per_node=4",
               "train.global_batch=32", "train.micro_batch=8", "train.log_every=1000", "fault.max_restarts=0",
               f"run.root={tmp_path}"]
    finish([*at_sync, "run.name=four"], tmp_path)
    reference = losses(tmp_path / "four")
    run = tmp_path / "shrunk"
    kill_after([*at_sync, "run.name=shrunk"], tmp_path, run, step=9)
    finish(replicas([*at_sync, "run.name=shrunk"], 2), tmp_path)
    (loaded,) = events(run, "checkpoint_loaded")
    step = loaded["step"]
    assert step % 4 == 0 and loaded["from_world_size"] == 4
    (changed,) = events(run, "sync_replicas_changed")
    assert changed == {**changed, "step": step, "from_replicas": 4, "replicas": 2, "synced_at": step,
                       "inner_steps_dropped": 0}
    after = losses(run)
    assert after[step + 1][1] == reference[step + 1][1]  # the same samples
    assert abs(after[step + 1][0] - reference[step + 1][0]) <= 1e-5 * reference[step + 1][0]
    assert sorted(after) == list(range(1, 13))

    between = ["+sync=diloco", "sync.every=4", "sync.fragments=2", *JOB, "train.steps=18", "tasks_per_node=2",
               "run.name=grown", f"run.root={tmp_path}"]
    run = tmp_path / "grown"
    kill_after(between, tmp_path, run, step=7)
    proc = dtk("dtk.submit", *replicas(between, 4), cwd=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (loaded,) = events(run, "checkpoint_loaded")
    step = loaded["step"]
    assert step % 2 == 1, loaded  # saves at 5, 10, 15: 5 or 15 lie between two fragments' synchronizations
    (changed,) = events(run, "sync_replicas_changed")
    # fragment 0 synchronizes after the steps 4, 8, ..., fragment 1 after 2, 6, ...: the older one counts
    synced_at = min(step - step % 4, step - (step - 2) % 4)
    assert changed == {**changed, "step": step, "from_replicas": 2, "replicas": 4, "synced_at": synced_at,
                       "inner_steps_dropped": step - synced_at}
    log = (sorted((run / "logs").glob("start_*"))[-1] / "rank_0.log").read_text()
    assert "written by 2 replicas and this job has 4: every replica continues from the last synchronized" in log
    path = run / "checkpoints" / "step_00000018"
    saved = load_model_state(path, json.loads((path / "manifest.json").read_text()))
    for name, tensor in synchronized(saved).items():
        assert all(torch.equal(saved[f"replica{r}.{name}"], tensor) for r in range(4)), name


def test_more_fragments_than_the_models_tensors_is_one_error_line_from_the_workers(tmp_path):
    """The planner cannot count a model's tensors without building it: the workers refuse
    at the start, with one line and exit 2 (a configuration error: no relaunch)."""
    proc = dtk("dtk.submit", "+sync=diloco", "sync.every=32", "sync.fragments=32", "tasks_per_node=2",
               "train.steps=4", f"run.root={tmp_path}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: sync.fragments=32: the model has 22 trainable tensors"), line
    assert "Traceback" not in proc.stderr
