"""End to end on the local cluster: real worker processes, gloo, DDP, DCP checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plan_md_check import assert_plan_md_matches_mesh

from conftest import REPO, dtk, losses, only_run_dir, run_dirs

pytestmark = [pytest.mark.slow, pytest.mark.dist]

JOB = ["train.steps=60", "checkpoint.every=20", "train.log_every=20"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run of JOB, shared by the tests that compare against it."""
    root = tmp_path_factory.mktemp("reference")
    proc = dtk("dtk.submit", *JOB, f"run.root={root}", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return only_run_dir(root)


def test_default_job_leaves_a_complete_run_directory(reference):
    for name in ("config.yaml", "metrics.jsonl", "events.jsonl", "summary.json", "plan.json", "plan.md", "mesh.json"):
        assert (reference / name).is_file(), name
    assert_plan_md_matches_mesh(reference)  # the topology scheme handed over is the mesh the workers built
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 61))
    for key in ("step", "loss", "lr", "world_size", "restart", "step_time_s"):
        assert key in records[0]
    assert {r["world_size"] for r in records} == {2}
    assert records[-1]["loss"] < 0.8 * records[0]["loss"]
    manifests = list((reference / "checkpoints").glob("step_*/manifest.json"))
    assert len(manifests) == 2  # checkpoint.keep=2 of steps 20, 40, 60
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final_step"] == 60
    assert summary["final_loss"] == records[-1]["loss"]
    # Predicted against measured on both ranks: the states plus what one step kept for backward.
    memory = summary["memory"]
    assert [r["rank"] for r in memory["ranks"]] == [0, 1] and memory["device"] == "cpu"
    for r in memory["ranks"]:
        assert r["measured"]["params"] == r["predicted"]["params"] and r["measured"]["grads"] == r["predicted"]["grads"]
        assert r["measured"]["optimizer"] == r["predicted"]["optimizer"]
        assert abs(r["gap"]) <= 0.10 and r["measured_bytes"] > 0, r
    assert memory["mismatch_ranks"] == []
    shown = dtk("dtk.status", str(reference)).stdout
    assert f"memory       {memory['measured_bytes'] / 1e9:.3f} GB measured on the largest rank against" in shown
    events = [json.loads(line)["event"] for line in (reference / "events.jsonl").read_text().splitlines()]
    assert events[0] == "submitted" and events[1] == "started" and events[-1] == "finished"
    # The fabric, chosen before the process group: one node, so the loopback; the check recorded.
    topology = json.loads((reference / "topology.json").read_text())
    assert topology["choice"]["interface"] == "lo" and topology["env"][topology["nodes"][0]["node"]]["GLOO_SOCKET_IFNAME"] == "lo"
    assert len(topology["layout"]["rank_nodes"]) == 2 and topology["transport_check"]["problems"] == []
    assert "topology" in events and events.index("topology") < events.index("ready")


def test_same_command_twice_gives_bitwise_identical_losses(reference, tmp_path):
    proc = dtk("dtk.submit", *JOB, f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert losses(only_run_dir(tmp_path)) == losses(reference)


def test_running_a_finished_run_again_starts_nothing(reference):
    before = (reference / "events.jsonl").read_text()
    proc = dtk("dtk.submit", *JOB, f"run.root={reference.parent}")
    assert proc.returncode == 0, proc.stderr
    assert f"run {reference.name} already finished" in proc.stdout and f"run.name={reference.name}-2" in proc.stdout
    assert (reference / "events.jsonl").read_text() == before


def _wait_for_step(run_root: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before it could be killed"
        runs = run_dirs(run_root) if run_root.exists() else []
        if runs and (runs[0] / "metrics.jsonl").exists() and losses(runs[0]) and max(losses(runs[0])) >= step:
            return runs[0]
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def test_sigkill_of_the_workers_then_the_same_command_resumes(reference, tmp_path):
    root = tmp_path / "runs"
    cmd = [sys.executable, "-m", "dtk.submit", *JOB, f"run.root={root}", "fault.max_restarts=0"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = _wait_for_step(root, 45, driver)
    for pid in (run / "logs" / "start_00" / "pids").read_text().split():
        os.kill(int(pid), signal.SIGKILL)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode == 1
    assert "fault.max_restarts=0" in err and "worker rank" in err and "SIGKILL" in err

    proc = dtk("dtk.submit", *JOB, f"run.root={root}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[0]["step"] == 40
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed[0]["restart"] == 1
    assert losses(run) == losses(reference)
    assert json.loads((run / "summary.json").read_text())["final_loss"] == losses(reference)[60]


def _events(run: Path, name: str) -> list[dict]:
    """The events named `name` so far. The log may not exist yet (the driver writes plan.json
    before its first event), and a line still being written is not an event yet."""
    path = run / "events.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [e for e in map(json.loads, lines) if e["event"] == name]


def _wait(what: str, check, driver: subprocess.Popen, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        assert driver.poll() is None, f"the driver ended before {what}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _rank_pid(run: Path, start: int, rank: int, driver: subprocess.Popen) -> int:
    pid_file = run / "logs" / f"start_{start:02d}" / f"rank_{rank}.pid"
    return int(_wait(f"rank {rank}'s pid file", lambda: pid_file.exists() and pid_file.read_text().split(), driver)[1])


def _pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits undelivered for the process (it is stopped): /proc's ShdPnd mask."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False


def _pids(run: Path, start: int) -> list[int]:
    return [int(pid) for pid in (run / "logs" / f"start_{start:02d}" / "pids").read_text().split()]


def test_a_killed_and_a_hung_rank_are_relaunched_dtk_stop_saves_and_the_losses_match(reference, tmp_path):
    """The local driver relaunches after rank 1 is killed and after rank 1 hangs (SIGSTOP);
    then `dtk.stop` ends the run with a save and no relaunch, and the same command resumes
    it. The losses are the uninterrupted run's."""
    root = tmp_path / "runs"
    cmd = [sys.executable, "-m", "dtk.submit", *JOB, f"run.root={root}", "fault.hang_timeout_s=8"]
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = _wait_for_step(root, 25, driver)
    os.kill(_rank_pid(run, 0, 1, driver), signal.SIGKILL)
    _wait("a step after the relaunch", lambda: _events(run, "resumed"), driver)
    os.kill(_rank_pid(run, 1, 1, driver), signal.SIGSTOP)  # a hang: alive and silent
    _wait("a step after the second relaunch", lambda: len(_events(run, "resumed")) == 2, driver)
    # Hold the workers still, so that the run cannot finish before the stop arrives.
    for pid in _pids(run, 2):
        os.kill(pid, signal.SIGSTOP)
    stopper = subprocess.Popen([sys.executable, "-m", "dtk.stop", str(run)], env=dict(os.environ, PYTHONPATH=str(REPO)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait("the stop request", lambda: (run / "stop_request.json").exists(), driver)
    # The driver saw the request and signalled the held workers: SIGTERM waits, pending.
    _wait("the driver's SIGTERM to every worker", lambda: all(_pending(pid, signal.SIGTERM) for pid in _pids(run, 2)),
          driver)
    for pid in _pids(run, 2):
        os.kill(pid, signal.SIGCONT)
    said, err = stopper.communicate(timeout=120)
    assert stopper.returncode == 0, said + err
    out, err = driver.communicate(timeout=60)
    assert driver.returncode == 3, out + err

    crash, hang = _events(run, "relaunched")
    assert crash["cause"] == "crashed" and crash["rank"] == 1 and "SIGKILL" in crash["detail"]
    assert crash["resume_from"] == 20 and crash["host"] and "last_line" in crash
    assert hang["cause"] == "hung" and len(_events(run, "hang_detected")) == 1
    assert [e["restart"] for e in _events(run, "resumed")] == [1, 2]
    (stopped,) = _events(run, "stopped")
    assert said.startswith(f"stopped the local driver at step {stopped['step']}")
    assert f"resumes from checkpoint step {stopped['checkpoint']}" in said
    assert stopped["checkpoint"] == stopped["step"] < 60  # saved at the step it stopped
    status = json.loads(dtk("dtk.status", str(run), "--json").stdout)
    assert status["state"] == "stopped" and status["last_checkpoint"] == stopped["checkpoint"]
    first, after_crash, after_hang = status["starts"]
    assert after_crash["cause"].startswith("crashed: rank 1 on ") and after_hang["cause"].startswith("hung: ")
    assert after_crash["resumed_from"] == 20 and after_crash["steps_redone"] >= 5 and after_crash["downtime_s"] > 0
    assert after_hang["downtime_s"] >= 8  # the hang's detection wait is downtime
    assert [s["budget_left"] for s in status["starts"]] == [3, 2, 1] and status["relaunches_left"] == 1
    again = dtk("dtk.stop", str(run))
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "not running" in again.stderr

    proc = dtk("dtk.submit", *JOB, f"run.root={root}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert losses(run) == losses(reference)
