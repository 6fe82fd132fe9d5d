"""State a stopped or dead run leaves behind acts on nothing later: a stop request that was
never consumed, a dead driver's pid given to another process, a run lock freed while the
workers of a killed dtk.submit still save. Real files and real processes."""

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
from dtk.common.errors import UserError
from dtk.common.processes import driver_alive, process_identity, process_start
from dtk.common.rundir import RunDir
from dtk.launch.runlock import RunLock


def _run(tmp_path: Path, started: dict) -> RunDir:
    """A run directory whose last start was a local driver described by `started`."""
    from dtk.config.compose import compose
    from dtk.plan.plan import make_plan

    plan = make_plan(compose([f"run.root={tmp_path}"]))
    run = RunDir(Path(plan.run_dir))
    run.path.mkdir(parents=True)
    run.plan_json.write_text(plan.to_json())
    run.event("submitted", cluster="local", world_size=2)
    run.event("started", restart=0, job_id="local-1", nodes=["here"], world_size=2, **started)
    return run


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_stale_stop_request_is_removed_and_a_fresh_one_kept(tmp_path):
    run = _run(tmp_path, {"driver_pid": 0})
    submitted = run.events_list()[0]["time"]
    run.stop_request.write_text(json.dumps({"by": "bob", "now": False, "time": submitted - 60}))
    assert run.read_stop_request() is None and not run.stop_request.exists()
    run.stop_request.write_text(json.dumps({"by": "bob", "now": True, "time": submitted + 1}))
    assert run.read_stop_request() == {"by": "bob", "now": True, "time": submitted + 1}


def test_a_reused_pid_is_not_the_driver(tmp_path, sleeper):
    """The pid of the recorded driver now belongs to another process (started later): the
    run is not running, for dtk.status and dtk.stop alike."""
    theirs = process_identity(sleeper.pid)
    assert driver_alive(theirs)
    # The recorded driver started an hour earlier: the start of another process (pid 1's).
    reused = {**theirs, "driver_started": theirs["driver_started"] - 3600, "driver_start": process_start(1)}
    run = _run(tmp_path, reused)
    assert not driver_alive(reused)
    assert not driver_alive({**reused, "driver_start": ""})  # an older record: the epoch time alone
    assert not driver_alive({**theirs, "driver_name": "not-" + theirs["driver_name"]})
    shown = json.loads(dtk("dtk.status", str(run.path), "--json").stdout)
    assert shown["state"] != "running"
    proc = dtk("dtk.stop", str(run.path), "--timeout", "1")
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {run.path}: the run is not running"), proc.stderr
    assert not run.stop_request.exists()


def test_the_driver_is_still_itself_after_the_clock_moves(sleeper):
    """The epoch start psutil reports moves by a whole second when the kernel's boot time
    does (a clock adjustment); the recorded start in clock ticks after boot does not."""
    theirs = process_identity(sleeper.pid)
    assert theirs["driver_start"], "no start in ticks on a host with /proc"
    assert driver_alive({**theirs, "driver_started": theirs["driver_started"] - 1.0})
    assert driver_alive({**theirs, "driver_started": theirs["driver_started"] + 1.0})


def test_a_stop_that_gives_up_withdraws_its_request(tmp_path, sleeper):
    """A live driver that does not answer (here a process that reads no request): dtk.stop
    waits, says so, and leaves no request that would stop the next start."""
    run = _run(tmp_path, process_identity(sleeper.pid))
    assert json.loads(dtk("dtk.status", str(run.path), "--json").stdout)["state"] == "running"
    proc = dtk("dtk.stop", str(run.path), "--timeout", "1")
    assert proc.returncode == 0, proc.stderr
    assert "has not stopped within 1 s, and the request is withdrawn" in proc.stdout
    assert not run.stop_request.exists()


@pytest.mark.slow
@pytest.mark.dist
def test_killing_dtk_submit_keeps_the_run_locked_until_its_workers_exit(tmp_path):
    """SIGKILL of dtk.submit: its workers get SIGTERM (they save, then exit). Until the last
    has exited no other launch may take the run. The workers are held still (SIGSTOP) so
    that they are certainly alive when the second launch asks."""
    args = ["train.steps=2000", "checkpoint.every=1000", "train.log_every=1", "run.name=killed",
            f"run.root={tmp_path}"]
    first = subprocess.Popen([sys.executable, "-m", "dtk.submit", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    run = tmp_path / "killed"
    deadline = time.monotonic() + 180
    while not (run / "metrics.jsonl").exists():
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    workers = [int(p) for p in (run / "logs" / "start_00" / "pids").read_text().split()]
    try:
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        first.kill()
        first.wait()
        with pytest.raises(UserError, match=f"run directory {run} is in use by local job local-{first.pid}"):
            RunLock(run).acquire(job_state=None)
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 180
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "the workers did not exit after SIGTERM"
        time.sleep(0.2)
    with RunLock(run) as lock:  # the last worker's exit freed the run
        lock.acquire(job_state=None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
