"""dtk.watch on the lab: a driver stopped with SIGSTOP whose workers then die is a job Slurm
still calls RUNNING that nobody recovers; the watcher names it silent, once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk, only_run_dir
from lab_support import job_gone

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def watch_once(root: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "dtk.watch", str(root), "--once", "--json"], capture_output=True,
                          text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def driver_pid(job: str) -> int:
    """The job's driver: the batch script's python (submitit) with this job's SLURM_JOB_ID."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"submitit" in a for a in argv) and f"SLURM_JOB_ID={job}".encode() in env and b"python" in argv[0]:
            return int(proc.name)
    raise AssertionError(f"no driver process of job {job}")


def test_a_stopped_driver_whose_workers_died_is_silent(lab, tmp_path):
    proc = dtk("dtk.submit", "cluster=lab", "nodes=1", "tasks_per_node=1", "train.steps=100000",
               "train.global_batch=8", "fault.hang_timeout_s=3", "checkpoint.every=0", f"run.root={tmp_path}",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job,) = re.findall(r"submitted job (\d+)", proc.stdout)
    stopped = None
    try:
        deadline = time.monotonic() + 180
        run = None
        while time.monotonic() < deadline:
            dirs = [p for p in tmp_path.iterdir() if (p / "heartbeat").exists()]
            if dirs and list((dirs[0] / "logs").glob("start_*/rank_0.pid")):
                run = dirs[0]
                break
            time.sleep(0.5)
        assert run is not None, "the lab run did not start within 180 s"
        assert run == only_run_dir(tmp_path)
        stopped = driver_pid(job)
        os.kill(stopped, signal.SIGSTOP)
        host, pid = next((run / "logs").glob("start_*/rank_0.pid")).read_text().split()
        os.kill(int(pid), signal.SIGKILL)  # a crash the stopped driver does not see
        deadline = time.monotonic() + 120
        out = ""
        while '"silent"' not in out and time.monotonic() < deadline:
            time.sleep(1)
            out = watch_once(tmp_path)
        record = next(json.loads(line) for line in out.splitlines() if '"silent"' in line)
        assert (record["job_id"], record["run"]) == (job, run.name)
        assert '"silent"' not in watch_once(tmp_path)  # said once
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        subprocess.run(["scancel", job])
        deadline = time.monotonic() + 120
        while not job_gone(job):
            assert time.monotonic() < deadline, f"job {job} still queued"
            time.sleep(1)
