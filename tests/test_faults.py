"""Fault drills on the lab cluster: preemption, time limit, node failure (with and without a
spare), crash, hang, and a job that fails at every start. Each drill is injected for real
with `python -m dtk.drill` into a live run, which must recover and finish.

Tolerance: with this model in fp32 on CPU, a resume on the same world size is bitwise
equal to the uninterrupted run (asserted exactly); a run that continues on fewer workers
changes only the summation order of the gradient all-reduce, so its final loss is checked
to rtol 1e-5.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk, losses, only_run_dir
from lab_support import CONDITIONAL, STEPS, TRAIN, job_gone, node_state, procedure

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LAB = ["cluster=lab", "nodes=2", "tasks_per_node=1", "fault.hang_timeout_s=10", *TRAIN]


@pytest.fixture
def reference(lab_reference) -> dict[int, float]:
    """The uninterrupted run: same config and world size (2), on the local cluster."""
    return lab_reference


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def named(run: Path, name: str) -> list[dict]:
    return [e for e in events(run) if e["event"] == name]


def submit(tmp_path: Path, *extra: str) -> tuple[str, Path]:
    proc = dtk("dtk.submit", *LAB, *extra, f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.split("submitted job ", 1)[1].split()[0]
    return job, only_run_dir(tmp_path)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def step_reached(run: Path, step: int, restart: int | None = None) -> bool:
    if not (run / "metrics.jsonl").exists():
        return False
    for line in (run / "metrics.jsonl").read_text().splitlines()[::-1]:
        rec = json.loads(line)
        if restart is None or rec["restart"] == restart:
            return rec["step"] >= step
    return False


def finish(job: str, run: Path, timeout: float = 240) -> dict:
    try:
        wait_for(lambda: job_gone(job), timeout, f"job {job} to end")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    summary = json.loads((run / "summary.json").read_text())
    return summary


def drill(kind: str, run: Path, *args: str) -> float:
    t = time.time()
    proc = dtk("dtk.drill", kind, str(run), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return t


def steps_once_each(run: Path) -> bool:
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    return sorted(steps) == list(range(1, STEPS + 1))


def requeued_once_and_resumed(run: Path, job: str) -> dict:
    """One preemption of `job`, one requeue of the same job at its step, the second start
    resuming there, and every step computed once: the `preempted` event."""
    (preempted,) = named(run, "preempted")
    (requeued,) = named(run, "requeued")
    assert requeued["job_id"] == job and requeued["step"] == preempted["step"]
    started = named(run, "started")
    assert [s["restart"] for s in started] == [0, 1] and {s["job_id"] for s in started} == {job}
    resumed = named(run, "resumed")[-1]
    assert resumed["step"] == preempted["step"] and resumed["restart"] == 1
    assert steps_once_each(run), "a step was computed twice or lost"
    return preempted


def test_preemption_saves_requeues_and_loses_no_step(lab, tmp_path, reference):
    job, run = submit(tmp_path)
    wait_for(lambda: step_reached(run, 60), 120, "step 60")
    drill("preempt", run, "--hold", "5")
    summary = finish(job, run)
    assert summary["status"] == "finished", summary
    preempted = requeued_once_and_resumed(run, job)
    second = json.loads(dtk("dtk.status", str(run), "--json").stdout)["starts"][1]
    assert second["cause"].startswith("preempted") and second["resumed_from"] == preempted["step"], second
    assert second["steps_redone"] == 0 and second["downtime_s"] > 0, second
    assert losses(run) == reference


def test_scancel_and_dtk_stop_end_the_job_with_a_save_and_no_requeue(lab, tmp_path):
    job, run = submit(tmp_path)
    wait_for(lambda: step_reached(run, 60), 120, "step 60")
    subprocess.run(["scancel", job], check=True)
    wait_for(lambda: job_gone(job), 60, f"job {job} to end")
    # Slurm shows the job CANCELLED at once; its driver records the stop within KillWait after
    wait_for(lambda: named(run, "stopped"), 30, "the driver's stopped event")
    (stopped,) = named(run, "stopped")
    (preempted,) = named(run, "preempted")  # the workers saved on the cancel's SIGTERM
    assert stopped["by"] == f"scancel {job}" and stopped["checkpoint"] == preempted["step"] >= 60
    assert not named(run, "requeued") and len(named(run, "started")) == 1
    info = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True).stdout
    assert "JobState=CANCELLED" in info and "Restarts=0" in info, info
    status = json.loads(dtk("dtk.status", str(run), "--json").stdout)
    assert status["state"] == "stopped" and status["last_checkpoint"] == stopped["checkpoint"]

    job2, _ = submit(tmp_path)  # the same command resumes; then dtk.stop ends it the same way
    wait_for(lambda: step_reached(run, stopped["checkpoint"] + 20, restart=1), 120, "progress after the resume")
    proc = dtk("dtk.stop", str(run), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wait_for(lambda: job_gone(job2), 60, f"job {job2} to end")
    wait_for(lambda: len(named(run, "stopped")) == 2, 30, "the second stopped event")
    second = named(run, "stopped")[-1]
    assert proc.stdout.startswith(f"stopped job {job2} at step {second['step']}") and "not requeued" in proc.stdout
    assert second["by"].startswith("dtk.stop by ") and second["checkpoint"] == second["step"]
    assert not named(run, "requeued") and not (run / "stop_request.json").exists()
    info = subprocess.run(["scontrol", "show", "job", job2, "-o"], capture_output=True, text=True).stdout
    assert "JobState=COMPLETED" in info, info


def test_time_limit_saves_before_each_limit_and_resumes_where_it_saved(lab, tmp_path):
    # A real 1-minute limit with the signal 40 s ahead: each allocation trains until the
    # USR2, saves and is requeued, and the next one resumes at the saved step. Two limits
    # show the pattern; then the job is held and cancelled (the run itself is endless).
    job, run = submit(tmp_path, "cluster.time_min=1", "fault.signal_lead_floor_s=40", "train.steps=100000",
                      "checkpoint.every=100000")
    try:
        wait_for(lambda: len(named(run, "resumed")) >= 2, 420, "the start after the second time limit")
    finally:  # held back in the queue first: a scancel of a running job may save and requeue it
        subprocess.run(["scontrol", "requeuehold", job], capture_output=True)
        wait_for(lambda: job_field(job, "JobState") != "RUNNING", 60, "the job to stop")
        cancel(job)
    preempted, requeued, resumed = named(run, "preempted")[:2], named(run, "requeued")[:2], named(run, "resumed")[:2]
    assert [p["signal"] for p in preempted] == ["SIGUSR2", "SIGUSR2"] and all(p["saved"] for p in preempted)
    # No step lost or repeated: every allocation resumes exactly where the previous one saved.
    assert [r["step"] for r in requeued] == [p["step"] for p in preempted] == [r["step"] for r in resumed]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for restart, (first, last) in enumerate([(1, preempted[0]["step"]), (preempted[0]["step"] + 1, preempted[1]["step"])]):
        assert sorted(r["step"] for r in records if r["restart"] == restart) == list(range(first, last + 1))
    assert all(e["signal_lead_s"] == 40 for e in named(run, "submitted"))


def cancel(job: str) -> None:
    """scancel until Slurm shows the job ended: the driver's own requeue or release of the job
    at that moment can leave it PENDING after one scancel (seen: a passed test's job left queued)."""
    def ended() -> bool:
        if job_gone(job) or job_field(job, "JobState") in ("CANCELLED", "COMPLETED", "FAILED", "TIMEOUT"):
            return True
        subprocess.run(["scancel", job], capture_output=True)
        return False

    wait_for(ended, 60, f"job {job} to end", interval=2)


def node_fail_drill(tmp_path: Path, *extra: str, grow: bool = False, during=None) -> tuple[Path, dict, str]:
    """Submit, set a node of the run DOWN once it trains, wait for the end; the node is
    resumed afterwards whatever happened. `grow`: the job may grow back (a requeue) when the
    failed node returns to service before the end. `during(run, node)` runs after the drill,
    while the job runs on."""
    job, run = submit(tmp_path, *extra)
    wait_for(lambda: step_reached(run, 60), 120, "step 60")
    victim = named(run, "started")[0]["nodes"][-1]
    try:
        drill("node-fail", run)
        if during is not None:
            during(run, victim)
        summary = finish(job, run)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={victim}", "state=resume"], capture_output=True)
    assert summary["status"] == "finished", summary
    assert all(grow and r["reason"].startswith("grow back") for r in named(run, "requeued")), named(run, "requeued")
    return run, summary, victim


def follow_node_failure_procedure(run: Path, victim: str) -> None:
    """docs/recovery.md's node-failure procedure, each command as written (RUN_DIR and NODE
    filled in, `python` being dtk's python): each must succeed; the conditional step only
    where the document says it applies (a node whose slurmd is gone, which sinfo shows)."""
    (failed,) = wait_for(lambda: named(run, "node_failed"), 120, "the node_failed event")
    node = failed["nodes"][0]
    assert node == victim
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


def test_node_failure_continues_on_the_spare_without_requeue(lab, tmp_path, reference):
    """The failed node's place goes to the spare; meanwhile docs/recovery.md's node-failure
    procedure is followed on the run, command by command (its only real run)."""
    run, _, victim = node_fail_drill(tmp_path, "spare_nodes=1", during=follow_node_failure_procedure)
    (failed,) = named(run, "node_failed")
    assert failed["nodes"] == [victim]
    excluded = [e["node"] for e in json.loads((run / "excluded_nodes.json").read_text())]
    assert excluded == [victim]
    started = named(run, "started")
    assert len(started) == 2 and victim not in started[1]["nodes"] and len(started[1]["nodes"]) == 2
    assert named(run, "resumed")[-1]["step"] == failed["resume_from"]
    assert losses(run)[STEPS] == reference[STEPS]
    status = json.loads(dtk("dtk.status", str(run), "--json").stdout)
    assert status["state"] == "finished" and status["step"] == STEPS, status


def test_node_failure_without_spare_continues_on_one_node(lab, tmp_path, reference):
    # The third lab node is held by another job: no node can take the failed one's place, so
    # the run goes on at world 1 (with an idle node it would grow back: tests/test_grow.py).
    hold = subprocess.run(["sbatch", "--parsable", "-w", "node3", "-N1", "--job-name=dtk-test-hold", "--output=/dev/null",
                           "--wrap=sleep 600"], capture_output=True, text=True).stdout.strip()
    try:
        wait_for(lambda: job_field(hold, "JobState") == "RUNNING", 30, "the job holding node3")
        run, _, victim = node_fail_drill(tmp_path, grow=True)
    finally:
        subprocess.run(["scancel", hold], capture_output=True)
    started = named(run, "started")
    assert started[1]["nodes"] == [started[0]["nodes"][0]] and started[1]["world_size"] == 1
    assert victim in [e["node"] for e in json.loads((run / "excluded_nodes.json").read_text())]
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    if named(run, "grown"):  # the node came back to service and passed its health job: world 2 again
        (grown,) = named(run, "grown")
        assert [s["world_size"] for s in started] == [2, 1, 2] and victim in grown["nodes"]
        assert named(run, "preempted")[-1]["step"] == named(run, "requeued")[-1]["step"] == named(run, "resumed")[-1]["step"]
        assert last["world_size"] == 2
    else:
        assert len(started) == 2 and last["world_size"] == 1
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    assert math.isclose(losses(run)[STEPS], reference[STEPS], rel_tol=1e-5)
    (failed,) = named(run, "node_failed")
    second = json.loads(dtk("dtk.status", str(run), "--json").stdout)["starts"][1]
    assert second["cause"] == f"node failed: {victim}" and second["resumed_from"] == failed["resume_from"], second
    assert second["steps_redone"] >= 0 and second["downtime_s"] > 0, second


def test_crash_and_hang_recover_and_the_hang_is_seen_in_time(lab, tmp_path, reference):
    job, run = submit(tmp_path)
    wait_for(lambda: step_reached(run, 60), 120, "step 60")
    drill("crash", run)
    wait_for(lambda: named(run, "relaunched"), 60, "the relaunch after the crash")
    wait_for(lambda: step_reached(run, named(run, "relaunched")[0]["resume_from"] + 30, restart=1), 120,
             "progress after the crash")
    t_hang = drill("hang", run)
    summary = finish(job, run)
    assert summary["status"] == "finished", summary
    crash, hang = named(run, "relaunched")
    assert crash["cause"] == "crashed" and hang["cause"] == "hung"
    # The drill killed the last rank (1): srun's report names it, not rank 0's collective error.
    assert crash["detail"].startswith("rank 1 on node") and "died first" in crash["detail"], crash
    status = json.loads(dtk("dtk.status", str(run), "--json").stdout)
    causes = [s["cause"] for s in status["starts"]]
    assert causes[1].startswith("crashed: rank 1 on node") and causes[2].startswith("hung: "), causes
    (detected,) = named(run, "hang_detected")
    assert detected["time"] - t_hang <= 10 + 5, "hang seen later than fault.hang_timeout_s + 5 s"
    assert [r["restart"] for r in named(run, "resumed")] == [1, 2]
    assert all(r["recovery_s"] is not None and r["recovery_s"] < 60 for r in named(run, "resumed"))
    assert losses(run) == reference


def job_field(job: str, key: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True).stdout
    return next((t.split("=", 1)[1] for t in out.split() if t.startswith(f"{key}=")), "")


def test_an_excluded_node_stays_out_across_requeues_until_readmitted(lab, tmp_path):
    # No spare and no shrinking: the node failure requeues the job. Its ExcNodeList holds
    # the node (set while it was held), and the next allocation does not contain it even
    # once the node is back in service; after `dtk.nodes --readmit` the next requeue
    # clears it and the allocation may use the node again.
    job, run = submit(tmp_path, "fault.shrink=false", "train.steps=300")
    wait_for(lambda: step_reached(run, 40), 120, "step 40")
    victim = named(run, "started")[0]["nodes"][-1]
    try:
        drill("node-fail", run)
        wait_for(lambda: named(run, "requeued"), 60, "the requeue after the node failure")
        subprocess.run(["scontrol", "update", f"nodename={victim}", "state=resume"], capture_output=True)
        wait_for(lambda: job_field(job, "ExcNodeList") == victim, 30, f"ExcNodeList={victim}")
        wait_for(lambda: len(named(run, "started")) == 2, 120, "the second allocation")
        assert victim not in named(run, "started")[1]["nodes"]
        listed = dtk("dtk.nodes", str(run))
        assert victim in listed.stdout and "left the job" in listed.stdout, listed.stdout + listed.stderr
        back = dtk("dtk.nodes", str(run), "--readmit", victim)
        assert back.returncode == 0 and "its next requeue no longer excludes it" in back.stdout, back.stdout + back.stderr
        wait_for(lambda: named(run, "resumed") and step_reached(run, named(run, "resumed")[-1]["step"] + 10, restart=1),
                 120, "progress after the requeue")
        drill("preempt", run, "--hold", "5")
        wait_for(lambda: len(named(run, "requeued")) == 2, 120, "the requeue after the preemption")
        wait_for(lambda: job_field(job, "ExcNodeList") == "(null)", 30, "ExcNodeList cleared")
        summary = finish(job, run)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        subprocess.run(["scontrol", "update", f"nodename={victim}", "state=resume"], capture_output=True)
    assert summary["status"] == "finished", summary
    assert named(run, "requeued")[0]["exclude"] == [victim] and named(run, "requeued")[1]["exclude"] == []
    assert victim in named(run, "started")[2]["nodes"]  # the lab is idle: the lowest-numbered nodes are taken


def test_the_time_limit_drill_gives_the_requeued_job_its_limit_back(lab, tmp_path):
    job, run = submit(tmp_path, "cluster.time_min=5", "fault.signal_lead_floor_s=20", "train.steps=100000",
                      "checkpoint.every=1000")
    wait_for(lambda: step_reached(run, 20), 120, "step 20")
    try:
        out = dtk("dtk.drill", "timelimit", str(run))
        assert out.returncode == 0, out.stdout + out.stderr
        cut = re.search(r"time limit cut from 00:05:00 to (\S+) ", out.stdout)
        assert cut and cut.group(1) != "00:05:00", out.stdout  # what Slurm set, read back
        assert f"job {job} time limit restored: Slurm shows 00:05:00 (was 00:05:00)" in out.stdout, out.stdout
        (preempted,) = wait_for(lambda: named(run, "preempted"), 60, "the workers' stop on the signal")
        assert preempted["signal"] == "SIGUSR2"
        wait_for(lambda: len(named(run, "started")) == 2, 120, "the requeued job's start")
        assert job_field(job, "TimeLimit") == "00:05:00"
    finally:  # held back in the queue first: a scancel of a running job may save and requeue it
        subprocess.run(["scontrol", "requeuehold", job], capture_output=True)
        wait_for(lambda: job_field(job, "JobState") != "RUNNING", 60, "the job to stop")
        subprocess.run(["scancel", job], capture_output=True)


def test_a_save_slower_than_the_signal_lead_still_commits_before_the_time_limit(lab, tmp_path):
    # Each save takes 20 s (the test hook holds the commit) and the sbatch signal comes 5 s
    # before the limit: alone it would be killed in the middle of its save. The driver
    # watches the time left and stops the workers early enough for the save to commit.
    proc = dtk("dtk.submit", "cluster=lab", "nodes=2", "tasks_per_node=1", *TRAIN[:1], "train.steps=1000000",
               "checkpoint.every=0", "train.log_every=500", "cluster.time_min=1", "fault.signal_lead_floor_s=5",
               f"run.root={tmp_path}", cwd=tmp_path, env={"DTK_TEST_COMMIT_DELAY_S": "20"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.split("submitted job ", 1)[1].split()[0]
    run = only_run_dir(tmp_path)
    try:
        wait_for(lambda: named(run, "resumed"), 300, "the start after the time limit")
    finally:  # held back in the queue first: a scancel of a running job may save and requeue it
        subprocess.run(["scontrol", "requeuehold", job], capture_output=True)
        wait_for(lambda: job_field(job, "JobState") != "RUNNING", 60, "the job to stop")
        subprocess.run(["scancel", job], capture_output=True)
    (near,) = named(run, "time_limit_near")[:1]
    (saved,) = named(run, "checkpoint_saved")[:1]
    assert saved["seconds"] >= 20 and near["need_s"] >= 30 > 5
    (requeued,) = named(run, "requeued")[:1]
    assert requeued["step"] == saved["step"] == named(run, "preempted")[0]["step"] == named(run, "resumed")[0]["step"]
    assert (Path(saved["path"]) / "manifest.json").is_file()  # committed
    first = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["restart"] == 0]
    assert max(first) == saved["step"] > 0  # no step computed after the save: none lost
