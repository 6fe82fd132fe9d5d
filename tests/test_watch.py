"""dtk.watch on run directories written by hand from recorded events (the fields the drivers
write: dtk/driver/local.py, supervisor.py), and the command as cron runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, dtk, run_main
from dtk import watch

T0 = 1_800_000_000.0


def make_run(root: Path, name: str, events: list[dict], *, plan: dict | None = None, excluded: list[dict] | None = None,
             summary: dict | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "plan.json").write_text(json.dumps(plan or {"run_name": name, "spare_nodes": 0,
                                                       "config": {"fault": {"max_restarts": 3, "hang_timeout_s": 60,
                                                                            "startup_timeout_s": 300}}}))
    if excluded is not None:
        (run / "excluded_nodes.json").write_text(json.dumps(excluded))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def started(t: float, restart: int, job: str = "4711") -> dict:
    return {"time": T0 + t, "event": "started", "restart": restart, "job_id": job, "slurm_restart_count": 0,
            "nodes": ["node1", "node2"], "world_size": 2}


def relaunched(t: float, attempt: int, job: str = "4711") -> dict:
    return {"time": T0 + t, "event": "relaunched", "job_id": job, "cause": "crashed", "detail": "rank 0 exited 1",
            "step": 0, "resume_from": 0, "attempt": attempt}


def crash_loop(first: float = 0.0, num_starts: int = 4) -> list[dict]:
    """A user model that raises at every start: started, crashed, relaunched, ..., failed."""
    events = [{"time": T0 + first - 5, "event": "submitted", "cluster": "slurm", "job_id": "4711", "world_size": 2}]
    for i in range(num_starts):
        events.append(started(first + 30 * i, i))
        if i < num_starts - 1:
            events.append(relaunched(first + 30 * i + 20, i + 1))
    return events


def never_running(job_id: str) -> str | None:
    return None


def detectors(alerts: list[watch.Alert]) -> list[tuple[str, str | None]]:
    return sorted((a.detector, a.run) for a in alerts)


def test_a_crash_loop_is_a_restart_storm_a_stall_and_a_spent_budget_each_said_once(tmp_path):
    make_run(tmp_path, "loop", crash_loop())
    now = T0 + 200
    first = watch.check(tmp_path, now=now, job_state=never_running)
    assert detectors(first) == [("budget_low", "loop"), ("restart_storm", "loop"), ("stalled_progress", "loop")]
    storm = next(a for a in first if a.detector == "restart_storm")
    assert "3 starts within 60 s" in storm.message and storm.details["starts"] == 4
    assert watch.check(tmp_path, now=now + 60, job_state=never_running) == []  # the same conditions: no repeat


def test_a_condition_that_clears_and_comes_back_is_said_again(tmp_path):
    run = make_run(tmp_path, "r", crash_loop(num_starts=3))
    assert "restart_storm" in [a.detector for a in watch.check(tmp_path, now=T0 + 100, job_state=never_running)]
    # It saved, then ran for hours with two sparse restarts: no storm, no stall.
    more = [{"time": T0 + 200, "event": "checkpoint_saved", "step": 50, "seconds": 0.2},
            {"time": T0 + 300, "event": "requeued", "job_id": "4711", "step": 50, "reason": "time limit"},
            started(4000, 3), started(9000, 4)]
    with open(run / "events.jsonl", "a") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in more)
    assert watch.check(tmp_path, now=T0 + 9100, job_state=never_running) == []
    with open(run / "events.jsonl", "a") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in [started(9030, 5), started(9060, 6)])
    again = watch.check(tmp_path, now=T0 + 9100, job_state=never_running)
    assert sorted(a.detector for a in again) == ["restart_storm", "stalled_progress"]  # 4 starts since step 50


def test_a_node_excluded_by_two_runs_is_suspect_and_spares_run_out(tmp_path):
    exclusion = {"node": "node2", "job_id": "4711", "reason": "node_failed", "time": T0 + 10}
    make_run(tmp_path, "a", [started(0, 0)], excluded=[exclusion],
             plan={"spare_nodes": 1, "config": {"fault": {"max_restarts": 3}}})
    make_run(tmp_path, "b", [started(0, 0, "4712")], excluded=[dict(exclusion, job_id="4712")])
    back = dict(exclusion, node="node3", readmitted={"by": "ops", "reason": "fixed", "time": T0 + 99})
    make_run(tmp_path, "c", [started(0, 0, "4713")], excluded=[back])
    make_run(tmp_path, "d", [started(0, 0, "4714")], excluded=[dict(back, job_id="4714")])
    alerts = watch.check(tmp_path, now=T0 + 100, job_state=never_running)
    assert detectors(alerts) == [("spares_exhausted", "a"), ("suspect_node", None)]
    suspect = next(a for a in alerts if a.detector == "suspect_node")
    assert suspect.details == {"node": "node2", "runs": ["a", "b"]}  # node3 was given back by both


def test_silent_is_a_running_job_whose_heartbeat_went_stale(tmp_path):
    run = make_run(tmp_path, "s", [started(0, 0)])
    (run / "heartbeat").touch()
    os.utime(run / "heartbeat", (T0 + 50, T0 + 50))
    running = {"4711": "RUNNING"}.get
    assert watch.check(tmp_path, now=T0 + 150, job_state=running) == []  # 100 s: within 2 x hang_timeout_s
    assert watch.check(tmp_path, now=T0 + 400, job_state=never_running) == []  # Slurm says it is not running
    alerts = watch.check(tmp_path, now=T0 + 400, job_state=running)
    assert [a.detector for a in alerts] == ["silent"] and alerts[0].details == {"job_id": "4711", "silent_s": 350.0}
    # Before its first heartbeat a start has fault.startup_timeout_s.
    make_run(tmp_path, "fresh", [started(300, 0, "4800")])
    assert watch.check(tmp_path, now=T0 + 800, job_state={"4711": "RUNNING", "4800": "RUNNING"}.get) == []


def test_a_local_run_is_running_while_its_driver_lives():
    assert watch.job_state(f"local-{os.getpid()}") == "RUNNING"
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert watch.job_state(f"local-{done.stdout.strip()}") is None


def test_a_finished_run_raises_nothing(tmp_path):
    make_run(tmp_path, "done", crash_loop() + [{"time": T0 + 500, "event": "finished", "step": 100}],
             summary={"status": "finished", "final_step": 100})
    assert watch.check(tmp_path, now=T0 + 600, job_state=never_running) == []


def _watch(*args: str, squeue: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m dtk.watch ARGS`; with `squeue`, a folder first on PATH whose squeue knows no job
    (this machine's Slurm may run the lab's jobs, or have its controller down: 18 s a query)."""
    path = f"{squeue}:{os.environ['PATH']}" if squeue else os.environ["PATH"]
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "dtk.watch", *args], capture_output=True,
                          text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), PATH=path), timeout=60)


def _squeue_that_knows_no_job(folder: Path) -> Path:
    folder.mkdir()
    script = folder / "squeue"
    script.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
    script.chmod(0o755)
    return folder


def test_the_command_prints_each_alert_once_and_hands_it_to_alert_as_json(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "loop", crash_loop())
    got = tmp_path / "alerts.jsonl"
    squeue = _squeue_that_knows_no_job(tmp_path / "bin")
    done = _watch(str(root), "--once", "--json", "--alert", f"cat >> {got}", squeue=squeue)
    assert done.returncode == 0, done.stderr
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(p["alert"] for p in printed) == ["budget_low", "restart_storm", "stalled_progress"]
    assert [json.loads(line) for line in got.read_text().splitlines()] == printed
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "import time:" in line}
    assert not imported & {"torch", "omegaconf", "hydra", "numpy"}, "the watcher imports only the standard library"
    again = _watch(str(root), "--once", squeue=squeue)
    assert (again.returncode, again.stdout) == (0, "")
    assert (root / watch.STATE).is_file()


def test_a_run_root_that_is_not_there_is_one_error_line(tmp_path):
    done = _watch(str(tmp_path / "nope"), "--once")
    lines = [line for line in done.stderr.splitlines() if "import time:" not in line]
    assert done.returncode == 2 and lines == [f"error: RUN_ROOT={tmp_path / 'nope'}: no such folder; give the run root"
                                              " (run.root) that holds run directories"]


def test_a_run_directory_instead_of_its_root_is_one_error_line_naming_the_root(tmp_path):
    run = make_run(tmp_path / "runs", "loop", crash_loop())
    done = run_main("dtk.watch", str(run), "--once")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"error: RUN_ROOT={run}: is a run directory, not a run root; dtk.watch watches every run"
                           f" of a root: python -m dtk.watch {tmp_path / 'runs'}\n")
    assert not (run / watch.STATE).exists()


CRASHING_YAML = """\
_target_: tests.models_for_tests.build_crashing
vocab_size: 256
seq_len: 32
width: 8
depth: 1
"""


@pytest.mark.slow
def test_a_real_run_whose_model_crashes_at_every_start_is_a_restart_storm(tmp_path):
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "crashing.yaml").write_text(CRASHING_YAML)
    root = tmp_path / "runs"
    proc = dtk("dtk.submit", f"hydra.searchpath=[file://{conf}]", "model=crashing", "tasks_per_node=1",
               "train.steps=4", "train.global_batch=4", "fault.max_restarts=3", f"run.root={root}", cwd=REPO)
    assert proc.returncode != 0 and "relaunching" in proc.stderr, proc.stdout + proc.stderr
    done = _watch(str(root), "--once", "--json")
    assert done.returncode == 0, done.stderr
    alerts = {json.loads(line)["alert"]: json.loads(line) for line in done.stdout.splitlines()}
    assert set(alerts) == {"restart_storm", "stalled_progress", "budget_low"}, done.stdout
    assert alerts["restart_storm"]["starts"] == 4 and alerts["budget_low"]["relaunches_left"] == 0
    assert _watch(str(root), "--once").stdout == ""


@pytest.mark.slow
def test_a_real_run_stopped_with_sigstop_is_silent(tmp_path):
    """Driver and workers stopped (as a frozen node stops them): the driver's process lives,
    so the run counts as running, and nobody touches the heartbeat."""
    import signal
    import time

    root = tmp_path / "runs"
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", "train.steps=100000", "train.global_batch=8",
                               "tasks_per_node=1", "fault.hang_timeout_s=2", "checkpoint.every=0", f"run.root={root}"],
                              cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log,
                              stderr=subprocess.STDOUT)
    stopped: list[int] = []
    try:
        beat = None
        while beat is None:
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()
            beat = next(iter(root.glob("*/heartbeat")), None) if root.is_dir() else None
            time.sleep(0.1)
        run = beat.parent
        while not list((run / "logs").glob("start_*/pids")):
            time.sleep(0.1)
        pids = [int(p) for p in next((run / "logs").glob("start_*/pids")).read_text().split()]
        for pid in [driver.pid, *pids]:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        assert _watch(str(root), "--once").stdout == ""  # stopped just now: within 2 x fault.hang_timeout_s
        deadline = time.monotonic() + 60
        silent = ""
        while "silent" not in silent and time.monotonic() < deadline:
            time.sleep(1)
            silent = _watch(str(root), "--once", "--json").stdout
        record = json.loads(silent.splitlines()[0])
        assert (record["alert"], record["job_id"], record["run"]) == ("silent", f"local-{driver.pid}", run.name)
        assert _watch(str(root), "--once").stdout == ""
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGKILL)
        driver.wait(timeout=60)
