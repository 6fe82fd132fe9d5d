"""A node name written to end its #SBATCH line and run a command, on the lab's real sbatch.

Two runs of a run root 'exclude' node3 and a name with newlines that would, on the
`#SBATCH --exclude=` line, end it and `touch` a marker as whoever submits next (and make
sbatch ignore every later #SBATCH line). The dry run and a real submission under that root
leave the name out: the job has its intended options (ExcNodeList node3, its time limit,
requeue) and the marker never appears, not even once the batch script ran the driver.
The driver's resubmission (PreemptMode=CANCEL) builds its script from the same names: it
too leaves the name out, and the audit log records it. Unit tests: tests/test_nodenames.py."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from conftest import dtk
from dtk.common.rundir import RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def poisoned_root(root: Path, marker: Path) -> str:
    name = f"node1\ntouch {marker}\n#"
    for run in ("first", "second"):
        (root / run).mkdir()
        RunDir(root / run).event("started", restart=0, job_id="1", nodes=["node2", "node3"])
        entries = [{"node": n, "job_id": "1", "reason": "left", "time": time.time()} for n in ("node3", name)]
        (root / run / "excluded_nodes.json").write_text(json.dumps(entries))
    return name


def job_info(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True).stdout


def wait_for_started(run: Path, job: str, timeout_s: float = 240) -> None:
    """Until the batch script ran as far as the driver's first start (or the job ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()] if (
            run / "events.jsonl").is_file() else []
        if any(e.get("event") == "started" for e in events) or "JobState=COMPLETED" in job_info(job):
            return
        time.sleep(1)
    raise AssertionError(f"job {job} did not start its workers within {timeout_s} s: {job_info(job)}")


def test_a_poisoned_node_name_under_the_root_runs_nothing_and_the_job_keeps_its_options(lab, tmp_path):
    marker = tmp_path / "injected"
    poisoned_root(tmp_path, marker)
    args = ("dtk.submit", "cluster=lab", "nodes=1", "tasks_per_node=1", "train.steps=5", "run.name=third",
            f"run.root={tmp_path}")
    dry = dtk(*args, "submit.dry_run=true", cwd=tmp_path)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "#SBATCH --exclude=node3\n" in dry.stdout and "\ntouch" not in dry.stdout, dry.stdout
    assert "warning: ignoring 1 invalid node name(s)" in dry.stdout and r"'node1\ntouch " in dry.stdout

    proc = dtk(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.split("submitted job ", 1)[1].split()[0]
    try:
        info = job_info(job)
        assert "ExcNodeList=node3 " in info and "TimeLimit=00:30:00" in info and "Requeue=1" in info, info
        assert "NumNodes=1" in info and "JobName=dtk-third" in info, info
        wait_for_started(tmp_path / "third", job)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    assert not marker.exists()
    script = tmp_path / "third" / "slurm" / job / f"{job}_submission.sh"  # the batch script sbatch was given
    assert "#SBATCH --exclude=node3\n" in script.read_text() and "touch" not in script.read_text()


def test_the_drivers_resubmission_leaves_the_name_out_and_is_audited(lab, tmp_path):
    from dtk.common import audit
    from dtk.config.compose import compose
    from dtk.driver.resubmit import resubmit
    from dtk.driver.supervisor import drive
    from dtk.launch.runlock import RunLock
    from dtk.plan.plan import make_plan

    marker = tmp_path / "injected"
    name = poisoned_root(tmp_path, marker)
    plan = make_plan(compose(["cluster=lab", "nodes=1", "tasks_per_node=1", "train.steps=5", "run.name=third",
                              f"run.root={tmp_path}"]))
    run = RunDir(Path(plan.run_dir))
    run.path.mkdir()
    run.plan_json.write_text(plan.to_json())
    held = subprocess.run(["sbatch", "--parsable", "--hold", "--wrap", "true"], capture_output=True, text=True)
    assert held.returncode == 0, held.stderr
    first = held.stdout.strip().split(";")[0]
    with RunLock(run.path) as lock:  # the first job holds the run, as its driver would
        lock.acquire(job_state=lambda _job: None)
        lock.record(kind="slurm", job_id=first)
    second = None
    try:
        second = resubmit(run, plan, first, exclude=["node2", name], entry=drive)
        info = job_info(second)
        assert "ExcNodeList=node[2-3] " in info and f"Dependency=afterany:{first}" in info, info
        assert "TimeLimit=00:30:00" in info and "Requeue=1" in info, info
    finally:
        subprocess.run(["scancel", first] + ([second] if second else []), capture_output=True)
    (entry,) = audit.read(tmp_path)
    assert (entry["action"], entry["job_ids"], entry["after_job"], entry["by"]) == ("resubmit", [second], first, "driver")
    assert entry["exclude"] == ["node2", "node3"] and not marker.exists()
