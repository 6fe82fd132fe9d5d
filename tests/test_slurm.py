"""Real Slurm jobs on the lab cluster: submitit submission, the driver's srun step, lineage,
status, multirun, login-node checks and Slurm's own requeue after a node failure."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from plan_md_check import assert_plan_md_matches_mesh

from conftest import dtk, losses, only_run_dir, run_dirs
from dtk.launch.slurmctl import Slurm
from lab_support import job_gone

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Small and quick: every lab node has 2 CPUs and all share this machine's 2 cores.
JOB = ["cluster=lab", "train.global_batch=32", "train.log_every=10"]


def job_ids(stdout: str) -> list[str]:
    return re.findall(r"submitted job (\d+)", stdout)


def wait_gone(job_id: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job_gone(job_id):
            return
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} still in the queue after {timeout} s")


def status(run: Path) -> dict:
    proc = dtk("dtk.status", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def test_two_node_job_trains_to_completion_and_records_lineage(lab, tmp_path):
    proc = dtk("dtk.submit", *JOB, "nodes=2", "tasks_per_node=1", "train.steps=20", "submit.wait=true",
               f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job,) = job_ids(proc.stdout)
    run = only_run_dir(tmp_path)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["world_size"] for r in records} == {2}
    assert max(r["step"] for r in records) == 20
    started = [e for e in events(run) if e["event"] == "started"]
    assert len(started) == 1
    assert started[0]["job_id"] == job and started[0]["restart"] == 0
    # the two nodes Slurm gave the job (which two depends on what the lab's previous test left busy)
    allocated = Slurm().job_nodes(job)
    assert allocated and len(set(started[0]["nodes"])) == 2 and sorted(started[0]["nodes"]) == sorted(allocated), allocated
    # Each node's record gathered before the process group: two nodes, so not the loopback but
    # an interface both have (the lab's nodes share this machine's), the master on its address.
    topology = json.loads((run / "topology.json").read_text())
    assert [n["node"] for n in topology["nodes"]] == started[0]["nodes"]
    assert topology["layout"]["rank_nodes"] == started[0]["nodes"] and topology["choice"]["backend"] == "gloo"
    iface = topology["choice"]["interface"]
    first = next(i for i in topology["nodes"][0]["interfaces"] if i["name"] == iface)
    assert first["kind"] != "loopback" and topology["env"][started[0]["nodes"][1]]["GLOO_SOCKET_IFNAME"] == iface
    assert topology["choice"]["master_addr"] == first["ipv4"][0].split("/")[0]
    info = status(run)
    assert info["state"] == "finished" and info["step"] == 20 and info["job_ids"] == [job]
    assert info["final_loss"] == losses(run)[20]
    assert_plan_md_matches_mesh(run)  # rank 0 on the first node, rank 1 on the second, as plan.md says
    memory = json.loads((run / "summary.json").read_text())["memory"]  # gathered from both nodes
    assert [r["rank"] for r in memory["ranks"]] == [0, 1] and memory["measured_bytes"] > 0


def test_status_reports_a_running_job_step(lab, tmp_path):
    proc = dtk("dtk.submit", *JOB, "nodes=1", "tasks_per_node=1", "train.steps=400", f"run.root={tmp_path}",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job,) = job_ids(proc.stdout)
    run = only_run_dir(tmp_path)
    try:
        deadline = time.monotonic() + 120
        info = status(run)
        while not (info["state"] == "running" and info["step"] > 0) and time.monotonic() < deadline:
            time.sleep(0.5)
            info = status(run)
        assert info["state"] == "running" and info["slurm_state"] == "RUNNING"
        assert 0 < info["step"] < 400 and info["total_steps"] == 400
        text = dtk("dtk.status", str(run)).stdout
        assert f"job {job}" in text and "running" in text
    finally:
        subprocess.run(["scancel", job])
        wait_gone(job)


def test_multirun_over_two_learning_rates_submits_two_jobs_that_finish(lab, tmp_path):
    proc = dtk("dtk.submit", "-m", *JOB, "nodes=1", "tasks_per_node=1", "train.steps=15", "optim.lr=1e-3,3e-3",
               f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = job_ids(proc.stdout)
    assert len(ids) == 2 and ids[0] != ids[1]
    table = proc.stdout.split("run directory", 1)[1]
    for job in ids:
        assert job in table
        wait_gone(job)
    runs = sorted(run_dirs(tmp_path))
    assert len(runs) == 2
    for run in runs:
        assert str(run) in table
        assert status(run)["state"] == "finished"
    assert losses(runs[0])[15] != losses(runs[1])[15]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["cluster.partition=nope"], "cluster.partition=nope: no such partition (available: debug, high)"),
        (["nodes=4"], "nodes=4: partition debug has only 3 node(s)"),
    ],
)
def test_impossible_jobs_are_refused_before_submission(lab, tmp_path, overrides, needle):
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    proc = dtk("dtk.submit", *JOB, "tasks_per_node=1", *overrides, f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: {needle}")
    assert list(tmp_path.iterdir()) == []
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before


def test_sbatch_refusal_is_an_error_line_and_leaves_nothing(lab, tmp_path):
    proc = dtk("dtk.submit", *JOB, "tasks_per_node=1", "cluster.sbatch_extra=['--reservation=none-such']",
               f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: sbatch refused the job") and proc.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_node_failure_requeues_and_the_job_resumes_in_the_same_run(lab, tmp_path):
    # Without --no-kill (fault.survive_node_loss=false) a lost node ends the job and Slurm
    # requeues it; recovery inside the allocation is tested in test_faults.py.
    proc = dtk("dtk.submit", *JOB, "nodes=2", "tasks_per_node=1", "train.steps=120", "checkpoint.every=10",
               "fault.survive_node_loss=false", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job,) = job_ids(proc.stdout)
    run = only_run_dir(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while status(run)["last_checkpoint"] is None:
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.5)
        node = [e for e in events(run) if e["event"] == "started"][0]["nodes"][1]
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=test"], check=True)
        # The lab's cred_expire=10 holds a requeued job back for 10 s, not Slurm's default 120.
        deadline = time.monotonic() + 90
        while len([e for e in events(run) if e["event"] == "started"]) < 2:
            assert time.monotonic() < deadline, "the job did not start again"
            time.sleep(1)
        wait_gone(job)
    finally:
        subprocess.run(["scancel", job])
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
    started = [e for e in events(run) if e["event"] == "started"]
    assert [e["job_id"] for e in started] == [job, job]
    assert [e["restart"] for e in started] == [0, 1]
    assert [e["slurm_restart_count"] for e in started] == [0, 1]
    loaded = [e for e in events(run) if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["step"] >= 10
    info = status(run)
    assert info["state"] == "finished" and info["restarts"] == 1 and info["step"] == 120
