"""docs/recovery.md's node-failure procedure, followed command by command on the lab.

A run with a spare node trains; a node-failure drill sets one of its nodes DOWN; then each
command of the document's procedure block runs as written (RUN_DIR and NODE filled in,
`python` being dtk's python) and must succeed, the conditional resume only where the
document says it applies (a node whose slurmd is gone); the resume line is typed as written
whether the node came back by itself or not; and the run finishes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk, only_run_dir

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

END = "<!-- end procedure -->"
CONDITIONAL = "only when sinfo shows a *"  # NODE's slurmd does not answer


def procedure(name: str = "node-failure") -> list[tuple[str, str]]:
    """(command, comment) for each line of a procedure block of docs/recovery.md."""
    text = (REPO / "docs" / "recovery.md").read_text()
    block = text.split(f"<!-- procedure: {name} -->", 1)[1].split(END, 1)[0]
    steps = []
    for line in block.splitlines():
        if line.startswith("    ") and line.strip():
            command, _, comment = line.strip().partition("  #")
            steps.append((command.strip(), comment.strip()))
    return steps


def test_the_procedures_are_lists_of_commands():
    steps = procedure()
    assert len(steps) >= 5
    assert any(c.startswith("python -m dtk.status RUN_DIR") for c, _ in steps)
    assert sum(CONDITIONAL in comment for _, comment in steps) == 1
    assert [c for c, _ in procedure("restart-before")][-1] == "scontrol requeuehold JOB"
    assert "scontrol release JOB" in [c for c, _ in procedure("restart-after")]


def follow(name: str, **values: str) -> None:
    """Run each command of a procedure as written, with the placeholders filled in."""
    for command, _ in procedure(name):
        line = command
        for key, value in values.items():
            line = line.replace(key, value)
        line = re.sub(r"^python -m ", f"{sys.executable} -m ", line)
        done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def events(run: Path, name: str) -> list[dict]:
    if not (run / "events.jsonl").exists():
        return []
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == name]


def last_step(run: Path) -> int:
    if not (run / "metrics.jsonl").exists():
        return 0
    return max((json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()), default=0)


def node_state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def test_node_failure_procedure_of_the_recovery_doc(lab, tmp_path):
    proc = dtk("dtk.submit", "cluster=lab", "nodes=2", "tasks_per_node=1", "spare_nodes=1", "train.global_batch=32",
               "train.steps=240", "checkpoint.every=20", "train.log_every=40", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run = only_run_dir(tmp_path)
    node = None
    try:
        wait_for(lambda: last_step(run) >= 40, 180, "step 40")
        drilled = dtk("dtk.drill", "node-fail", str(run))
        assert drilled.returncode == 0, drilled.stderr
        failed = wait_for(lambda: events(run, "node_failed"), 120, "the node_failed event")
        node = failed[0]["nodes"][0]
        for command, comment in procedure():
            line = command.replace("RUN_DIR", str(run)).replace("NODE", node)
            line = re.sub(r"^python -m ", f"{sys.executable} -m ", line)
            if CONDITIONAL in comment:
                # The drill sets NODE down with its slurmd alive: the step for a node whose
                # slurmd is gone does not apply, as sinfo shows (no *).
                assert "*" not in node_state(node), node_state(node)
                continue
            done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, cwd=REPO, timeout=60)
            assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
        wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip(),
                 300, f"job {job} to end")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        if node is not None and node_state(node).startswith(("down", "drain")):
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
    status = json.loads(dtk("dtk.status", str(run), "--json").stdout)
    assert status["state"] == "finished" and status["step"] == 240, status
    assert node in [e["node"] for e in json.loads((run / "excluded_nodes.json").read_text())]


def job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\S+)", out)
    reason = re.search(r"Reason=(\S+)", out)
    return f"{state.group(1) if state else '?'} {reason.group(1) if reason else '?'}"


def test_planned_restart_procedure_saves_holds_and_resumes(lab, tmp_path):
    proc = dtk("dtk.submit", "cluster=lab", "nodes=1", "tasks_per_node=1", "train.global_batch=32", "train.steps=300",
               "checkpoint.every=100", "train.log_every=50", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run = only_run_dir(tmp_path)
    try:
        wait_for(lambda: last_step(run) >= 30, 180, "step 30")
        follow("restart-before", JOB=job, RUN_DIR=str(run))
        wait_for(lambda: job_state(job).startswith("PENDING"), 60, "the job back in the queue")
        saved = [e["step"] for e in events(run, "checkpoint_saved")]
        assert saved and 30 <= saved[-1] < 100, saved  # saved on the signal, not at the interval
        held_at = saved[-1]
        time.sleep(3)
        assert job_state(job).startswith("PENDING"), job_state(job)  # held: it does not start by itself
        follow("restart-after", JOB=job, RUN_DIR=str(run))
        wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip(),
                 300, f"job {job} to end")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    resumed = events(run, "resumed")
    assert resumed and resumed[-1]["step"] == held_at, resumed
    status = json.loads(dtk("dtk.status", str(run), "--json").stdout)
    assert status["state"] == "finished" and status["step"] == 300, status
