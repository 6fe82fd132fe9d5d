"""python -m dtk.nodes: a run's excluded nodes, and giving one back while the driver may
be writing the same file (real processes, real files; the lab test of the whole path is
tests/test_faults.py)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from conftest import run_main
from dtk.common.errors import UserError
from dtk.common.rundir import RunDir
from dtk.driver.exclusions import add_exclusions, read_entries, read_exclusions, readmit
from dtk.launch.slurmctl import Slurm
from dtk.nodes import readmit_node
from fake_slurm import FakeClock, FakeSlurm


def run_dir(tmp_path: Path) -> RunDir:
    path = tmp_path / "runs" / "tiny-abc"
    path.mkdir(parents=True)
    (path / "plan.json").write_text("{}")
    return RunDir(path)


def test_listing_shows_reason_and_time_and_readmit_keeps_the_history(tmp_path, monkeypatch):
    # A stand-in Slurm, not this machine's: a Slurm installed here whose controller is down
    # (the lab between tests) would cost the listing its 30 s of retries.
    fake = FakeSlurm(FakeClock(), ["node1", "node2"], [])
    fake.node_states["node2"] = "idle"
    monkeypatch.setattr("dtk.nodes._slurm", lambda: Slurm(fake, fake.clock))
    run = run_dir(tmp_path)
    add_exclusions(run, ["node2"], job_id="7", reason="node(s) node2 left the job")
    shown = run_main("dtk.nodes", str(run.path))
    assert shown.returncode == 0, shown.stderr
    line = shown.stdout.splitlines()[1]
    assert "node2" in line and "job 7" in line and "reason: node(s) node2 left the job" in line and "since 20" in line
    assert "slurm: idle" in line

    done = run_main("dtk.nodes", str(run.path), "--readmit", "node2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("node2 re-admitted to tiny-abc")
    assert read_exclusions(run) == []
    (entry,) = read_entries(run)
    assert entry["reason"] == "node(s) node2 left the job" and entry["readmitted"]["reason"] == "dtk.nodes --readmit"
    assert [e["event"] for e in run.events_list()] == ["node_readmitted"]
    from dtk.common.audit import read as read_audit

    audit = read_audit(tmp_path / "runs")
    assert audit[-1]["action"] == "readmit" and audit[-1]["node"] == "node2"
    listed = json.loads(run_main("dtk.nodes", str(run.path), "--json").stdout)
    assert [(e["node"], "readmitted" in e) for e in listed] == [("node2", True)]

    # Excluded again later: a new entry; the old one stays as history.
    add_exclusions(run, ["node2"], job_id="9", reason="node(s) node2 left the job")
    assert read_exclusions(run) == ["node2"] and len(read_entries(run)) == 2


def test_readmitting_a_node_the_run_does_not_exclude_is_one_error_line(tmp_path):
    run = run_dir(tmp_path)
    add_exclusions(run, ["node5"], job_id="7", reason="left")
    proc = run_main("dtk.nodes", str(run.path), "--readmit", "node2")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: --readmit node2: the run does not exclude node2 (excluded now: node5)"
    assert read_exclusions(run) == ["node5"] and not (run.path / "events.jsonl").exists()


def test_a_pending_job_of_the_run_gets_its_exclusion_list_updated(tmp_path):
    run = run_dir(tmp_path)
    run.event("started", job_id="42", restart=0, nodes=["node1"])
    add_exclusions(run, ["node2", "node3"], job_id="42", reason="left")
    fake = FakeSlurm(FakeClock(), ["node1"], [])
    fake.state, fake.excluded = "PENDING", ["node2", "node3"]
    said = readmit_node(run, "node2", Slurm(fake, fake.clock))
    assert said.endswith("pending job 42 may now be given it") and fake.excluded == ["node3"]
    fake.state = "RUNNING"
    said = readmit_node(run, "node3", Slurm(fake, fake.clock))
    assert said.endswith("job 42 is RUNNING: its next requeue no longer excludes it") and fake.excluded == ["node3"]


def _writer(path: str, node: str) -> None:
    run = RunDir(Path(path))
    for i in range(20):
        add_exclusions(run, [f"{node}-{i}"], job_id="1", reason="left")


def test_concurrent_writers_lose_no_change(tmp_path):
    # The driver adds while an operator readmits: every change survives (the lock), and
    # a reader never sees half a file (the atomic rename).
    run = run_dir(tmp_path)
    add_exclusions(run, ["keep", "back"], job_id="1", reason="left")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(run.path), f"w{k}")) for k in range(3)]
    for p in procs:
        p.start()
    readmit(run, "back", by="op", reason="repaired")
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    now = read_exclusions(run)
    assert "back" not in now and "keep" in now and len(now) == 1 + 3 * 20
    with pytest.raises(UserError, match="does not exclude back"):
        readmit(run, "back", by="op", reason="again")
