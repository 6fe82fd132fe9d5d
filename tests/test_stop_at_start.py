"""A stop signal that arrives while the workers start (imports done, process group, model
build, checkpoint load) is kept, not fatal: the workers train one step, save it, and stop
with exit 3 (dtk.worker.codes.EXIT_STOPPED), the code the Slurm driver requeues on; the
same command then finishes the run. Local driver, 2 real workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk

pytestmark = [pytest.mark.slow, pytest.mark.dist]

# 1000 steps: the first run's Ctrl-C must land before its end, which 300 steps (about 9 s
# after the first save on a quiet machine) did not always do on a busy one
JOB = ["tasks_per_node=2", "train.global_batch=16", "train.steps=1000", "checkpoint.every=20", "train.log_every=20",
       "run.name=stopped"]


def events(run: Path, name: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == name]


def test_usr2_while_the_workers_start_and_load_saves_at_the_first_step_and_stops_cleanly(tmp_path):
    run = tmp_path / "runs" / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "dtk.submit", *JOB, f"run.root={tmp_path / 'runs'}"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not any(e["step"] >= 20 for e in (events(run, "checkpoint_saved") if (run / "events.jsonl").exists() else [])):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # Ctrl-C: the workers save and stop
    proc.communicate(timeout=120)
    resumed_from = max(e["step"] for e in events(run, "checkpoint_saved"))

    # The same command again; USR2 to every worker as soon as it says where it runs (its pid
    # file comes before the process group, the model and the checkpoint load).
    before = set((run / "logs").glob("start_*"))
    again = subprocess.Popen([sys.executable, "-m", "dtk.submit", *JOB, f"run.root={tmp_path / 'runs'}"],
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    signalled: set[int] = set()
    deadline = time.monotonic() + 120
    while len(signalled) < 2:
        assert again.poll() is None and time.monotonic() < deadline, again.communicate()
        new = sorted(set((run / "logs").glob("start_*")) - before)  # this launch's first start
        for pid_file in new[0].glob("rank_*.pid") if new else []:
            text = pid_file.read_text().split()
            if len(text) == 2 and int(text[1]) not in signalled:
                os.kill(int(text[1]), signal.SIGUSR2)
                signalled.add(int(text[1]))
        time.sleep(0.01)
    out, err = again.communicate(timeout=240)
    history = (run / "events.jsonl").read_text()
    assert again.returncode == 3, out + err + history  # stopped after a committed checkpoint, not killed
    (loaded,) = [e for e in events(run, "checkpoint_loaded") if e["time"] > events(run, "started")[-1]["time"]]
    assert loaded["step"] == resumed_from
    preempted = events(run, "preempted")[-1]
    assert (preempted["step"], preempted["signal"], preempted["saved"]) == (resumed_from + 1, "SIGUSR2", True)
    assert (run / "checkpoints" / f"step_{resumed_from + 1:08d}" / "manifest.json").is_file()

    done = dtk("dtk.submit", *JOB, f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
