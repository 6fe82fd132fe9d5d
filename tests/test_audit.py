"""The audit log of a run root (dtk.common.audit) and the commands that write it: submit, drill,
checkpoint export and delete. Fast: hand-made run directories, no training."""

from __future__ import annotations

import json
import multiprocessing
import os
import pwd
import socket
import stat
import warnings
from pathlib import Path

import pytest

from conftest import dtk, run_main
from dtk.checkpoint import manifest as mf
from dtk.checkpoint.delete import delete_checkpoint
from dtk.common import audit
from dtk.common.errors import UserError


def make_run(root: Path, name: str = "transformer-0123456789", steps: tuple[int, ...] = (10, 20, 30)) -> Path:
    """A run directory with committed checkpoints that verify: a tiny DCP save each (verifying
    reads its `.metadata`), and a manifest."""
    import torch
    import torch.distributed.checkpoint as dcp

    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"run_name": name, "config_hash": "0123456789", "steps": 30}))
    for step in steps:
        folder = run / "checkpoints" / f"step_{step:08d}"
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": {"w": torch.full((4,), float(step))}}, checkpoint_id=str(folder), no_dist=True)
        mf.commit(folder, {"format": mf.FORMAT_VERSION, "step": step, "world_size": 1, "samples_consumed": step,
                           "files": {n: mf.describe_file(folder / n) for n in mf.payload_files(folder)}})
    return run


def test_an_entry_names_time_user_host_action_run_hash_and_jobs(tmp_path):
    entry = audit.record(tmp_path, "submit", run="r1", config_hash="abc", job_ids=[123], cluster="slurm")
    (path,) = (tmp_path / "audit").iterdir()
    assert path.name == "00000001.json" and json.loads(path.read_text()) == entry
    assert stat.S_IMODE(path.stat().st_mode) == 0o444  # nobody edits an entry in place
    me = pwd.getpwuid(os.getuid())
    assert entry["user"]["uid"] == os.getuid() and entry["user"]["name"] == me.pw_name
    assert entry["host"] == socket.gethostname()
    assert (entry["action"], entry["run"], entry["config_hash"], entry["job_ids"]) == ("submit", "r1", "abc", ["123"])
    assert entry["time"].endswith("Z") and entry["cluster"] == "slurm" and (entry["seq"], entry["prev"]) == (1, None)


def test_entries_are_chained_and_filtered_by_run(tmp_path):
    audit.record(tmp_path, "submit", run="a", job_ids=["1"])
    audit.record(tmp_path, "drill", run="b", job_ids=["2"], kind="crash")
    audit.record(tmp_path, "stop", run="a", job_ids=["1"])
    assert [e["action"] for e in audit.read(tmp_path)] == ["submit", "drill", "stop"]
    assert [e["action"] for e in audit.read(tmp_path, run="a")] == ["submit", "stop"]
    assert audit.verify(tmp_path).problems == []
    assert "kind=crash" in audit.describe(audit.read(tmp_path, run="b")[0])
    (tmp_path / "audit" / ".tmp-1-2").write_text('{"torn": ')  # a writer killed before its link: not an entry
    assert len(audit.read(tmp_path)) == 3 and audit.verify(tmp_path).problems == []


def test_a_changed_or_removed_entry_breaks_the_chain(tmp_path):
    for k in range(4):
        audit.record(tmp_path, "drill", run="r", job_ids=[str(k)])
    second = tmp_path / "audit" / "00000002.json"
    second.chmod(0o644)
    second.write_text(second.read_text().replace('"drill"', '"stop"'))  # its own writer rewrites it
    assert "entry 3 does not follow entry 2: one of them was changed" in audit.verify(tmp_path).problems
    (tmp_path / "audit" / "00000004.json").unlink()  # the newest, removed by its writer: the head knows
    problems = audit.verify(tmp_path).problems
    assert "the log ends at entry 3 but audit.head names entry 4: newer entries were removed" in problems
    (tmp_path / "audit" / "00000001.json").unlink()
    assert "entries 1 to 1 are missing: the start of the log was removed" in audit.verify(tmp_path).problems


def _write_many(root: str, tag: int) -> None:
    for k in range(50):
        audit.record(Path(root), "drill", run=f"r{tag}", job_ids=[str(k)], padding="x" * 300)


def test_concurrent_writers_never_share_a_number_or_break_the_chain(tmp_path):
    procs = [multiprocessing.get_context("fork").Process(target=_write_many, args=(str(tmp_path), t)) for t in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    log = audit.verify(tmp_path)
    assert log.problems == [] and [e["seq"] for e in log.entries] == list(range(1, 201))
    assert sorted(p.name for p in (tmp_path / "audit").iterdir())[-1] == "00000200.json"  # no temporary left


def test_unknown_action_is_an_internal_error(tmp_path):
    with pytest.raises(AssertionError):
        audit.record(tmp_path, "launch_missiles")


def test_delete_refuses_the_newest_verified_checkpoint_without_force(tmp_path):
    run = make_run(tmp_path)
    with pytest.raises(UserError, match="newest verified checkpoint.*back to step 20.*--force"):
        delete_checkpoint(run, step=30)
    assert (run / "checkpoints" / "step_00000030" / "manifest.json").is_file()
    with pytest.raises(UserError, match="--step 25: no checkpoint of that step.*steps: 10, 20, 30"):
        delete_checkpoint(run, step=25)
    assert not (tmp_path / "audit").exists()  # nothing done, nothing recorded


def test_delete_removes_the_folder_and_records_who(tmp_path):
    run = make_run(tmp_path)
    print(delete_checkpoint(run, step=20))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000010", "step_00000030"]
    delete_checkpoint(run, step=30, force=True)
    (first, second) = audit.read(tmp_path, run=run.name)
    assert (first["action"], first["step"], first["forced"]) == ("delete_checkpoint", 20, False)
    assert (second["step"], second["forced"], second["config_hash"]) == (30, True, "0123456789")


def test_checkpoint_delete_command_and_status_show_the_audit(tmp_path):
    run = make_run(tmp_path)
    proc = dtk("dtk.checkpoint", "delete", str(run), "--step", "10")  # the real entry point
    assert proc.returncode == 0, proc.stderr
    proc = run_main("dtk.checkpoint", "delete", str(run), "--step", "30")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --step 30 is the newest verified")
    proc = run_main("dtk.status", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads(proc.stdout)["audit"]
    assert entry["action"] == "delete_checkpoint" and entry["step"] == 10
    shown = run_main("dtk.status", str(run)).stdout
    assert "audit" in shown and "delete_checkpoint" in shown and f"{pwd.getpwuid(os.getuid()).pw_name}(" in shown


@pytest.mark.slow
def test_a_local_submit_records_who_submitted_which_config_with_which_job(tmp_path):
    proc = dtk("dtk.submit", "train.steps=4", "checkpoint.every=2", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (entry,) = audit.read(tmp_path)
    plan = json.loads(next(tmp_path.glob("*/plan.json")).read_text())
    assert (entry["action"], entry["run"], entry["config_hash"]) == ("submit", plan["run_name"], plan["config_hash"])
    started = [json.loads(line) for line in (tmp_path / plan["run_name"] / "events.jsonl").read_text().splitlines()
               if '"started"' in line]
    assert entry["job_ids"] == [started[0]["job_id"]] and entry["user"]["uid"] == os.getuid()
