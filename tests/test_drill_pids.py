"""dtk.drill signals only a dtk worker of the run it names: a pid file outlives its
process, and the pid may belong to anything by now. Real processes, no signal sent to a
process that is not the run's worker."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from dtk.common.errors import UserError
from dtk.common.rundir import RunDir
from dtk.drill.__main__ import _signal_worker, is_worker_of

SLEEP = "import time; time.sleep(60)"


def test_only_the_runs_own_worker_is_signalled(tmp_path):
    run, other = RunDir(tmp_path / "run"), RunDir(tmp_path / "other")
    # Processes whose command line reads like a worker of `run`, and like a stranger.
    worker = subprocess.Popen([sys.executable, "-c", SLEEP, "-m", "dtk.worker", str(run.path)])
    stranger = subprocess.Popen([sys.executable, "-c", SLEEP])
    try:
        assert is_worker_of(worker.pid, run) and not is_worker_of(worker.pid, other)
        assert not is_worker_of(stranger.pid, run)
        logs = run.log_dir(0)
        logs.mkdir(parents=True)
        start = {"restart": 0, "job_id": "1"}
        (logs / "rank_0.pid").write_text(f"{socket.gethostname()} {stranger.pid}\n")
        with pytest.raises(UserError, match=f"pid {stranger.pid} .* is not a dtk worker of {run.path}"):
            _signal_worker(run, start, 0, signal.SIGSTOP)
        assert stranger.poll() is None
        (logs / "rank_1.pid").write_text(f"{socket.gethostname()} {worker.pid}\n")
        assert _signal_worker(run, start, 1, signal.SIGKILL).startswith("sent SIGKILL to rank 1")
        assert worker.wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (worker, stranger):
            p.kill()
            p.wait()
    assert not is_worker_of(worker.pid, run)  # gone


def test_pid_alive_is_false_for_a_missing_or_unrecorded_pid():
    from dtk.common.processes import pid_alive

    proc = subprocess.Popen(["true"])
    proc.wait()
    assert pid_alive(os.getpid())
    assert not pid_alive(proc.pid)  # reaped: no such process
    assert not pid_alive(0)  # no pid recorded: not this process group
