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

from conftest import REPO, dtk, losses, only_run_dir

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
    assert "already finished" in proc.stdout
    assert (reference / "events.jsonl").read_text() == before


def _wait_for_step(run_root: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before it could be killed"
        runs = [p for p in run_root.iterdir() if p.is_dir()] if run_root.exists() else []
        if runs and (runs[0] / "metrics.jsonl").exists() and losses(runs[0]) and max(losses(runs[0])) >= step:
            return runs[0]
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def test_sigkill_of_the_workers_then_the_same_command_resumes(reference, tmp_path):
    root = tmp_path / "runs"
    cmd = [sys.executable, "-m", "dtk.submit", *JOB, f"run.root={root}"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = _wait_for_step(root, 45, driver)
    for pid in (run / "logs" / "start_00" / "pids").read_text().split():
        os.kill(int(pid), signal.SIGKILL)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode == 1
    assert "error: worker rank" in err and "SIGKILL" in err

    proc = dtk("dtk.submit", *JOB, f"run.root={root}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[0]["step"] == 40
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed[0]["restart"] == 1
    assert losses(run) == losses(reference)
    assert json.loads((run / "summary.json").read_text())["final_loss"] == losses(reference)[60]


def test_scheme_ddp_with_explicit_workers(tmp_path):
    proc = dtk("dtk.submit", "+scheme=ddp", "tasks_per_node=2", "train.steps=5", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = only_run_dir(tmp_path)
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]
    assert json.loads((run / "plan.json").read_text())["scheme"] == "ddp"
