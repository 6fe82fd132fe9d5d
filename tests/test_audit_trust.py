"""What the audit log shows is what the kernel confirms (dtk/common/audit.py): the user's name comes
from its file's owner, a stated name that differs is a forgery, `sudo_user` is shown as a
claim; and the driver's own actions, a requeue and a resubmission, are entries too (the
resubmission on the real Slurm: tests/test_nodenames_lab.py)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from conftest import require
from dtk.common import audit
from dtk.common.rundir import RunDir
from dtk.config.compose import compose
from dtk.driver.supervisor import Supervisor
from dtk.launch.slurmctl import Slurm
from dtk.plan.plan import make_plan
from dtk.worker.codes import EXIT_STOPPED
from fake_slurm import FakeClock, FakeSlurm, Script

NOBODY = 65534


def forge(root: Path, seq: int, *, uid: int, name: str) -> None:
    """Entry `seq`, chained to the one before, written as `uid` but stating `name`."""
    folder = audit.audit_path(root)
    before = (folder / f"{seq - 1:08d}.json").read_bytes()
    entry = {"seq": seq, "prev": audit._digest(before), "time": "2026-01-01T00:00:00Z", "unix_time": 1.0,
             "user": {"uid": uid, "name": name}, "host": "login1", "action": "stop", "run": "r", "config_hash": None,
             "job_ids": ["7"]}
    path = folder / f"{seq:08d}.json"
    path.write_text(json.dumps(entry) + "\n")
    os.chown(path, uid, -1)


def test_an_entry_that_states_another_name_than_its_owners_is_forged(tmp_path):
    require(os.getuid() == 0, "needs root to write a file as another uid")
    import pwd

    owner = pwd.getpwuid(NOBODY).pw_name
    audit.record(tmp_path, "submit", run="r", job_ids=["7"])
    forge(tmp_path, 2, uid=NOBODY, name="root")
    log = audit.verify(tmp_path)
    assert [e["seq"] for e in log.entries] == [1]
    assert log.problems == [f"entry 2 is forged: it names user root({NOBODY}) but was written by {owner}({NOBODY});"
                            " not shown"]
    # The same entry stating its owner's name is genuine, and shows that name.
    (audit.audit_path(tmp_path) / "00000002.json").unlink()
    forge(tmp_path, 2, uid=NOBODY, name=owner)
    log = audit.verify(tmp_path)
    assert log.problems == [] and audit.describe(log.entries[1]).split("  ")[1] == f"{owner}({NOBODY})@login1"


def test_sudo_user_is_shown_as_a_claim(tmp_path, monkeypatch):
    require(os.getuid() == 0, "sudo_user is recorded for root only")
    monkeypatch.setenv("SUDO_USER", "alice")
    entry = audit.record(tmp_path, "stop", run="r", job_ids=["7"])
    assert entry["user"]["sudo_user"] == "alice"
    who = audit.describe(audit.read(tmp_path)[0]).split("  ")[1]
    assert who.startswith("root(0)@") and who.endswith(" claims sudo_user=alice")


def test_a_requeue_by_the_driver_is_an_audit_entry(tmp_path):
    cfg = copy.deepcopy(compose(["cluster=lab", "nodes=2", "tasks_per_node=1", "train.global_batch=32"]))
    cfg.run.root = str(tmp_path)
    plan = make_plan(cfg)
    run = RunDir(Path(plan.run_dir))
    run.path.mkdir(parents=True)
    run.plan_json.write_text(plan.to_json())
    clock = FakeClock()
    fake = FakeSlurm(clock, ["node1", "node2"], [Script(exit=EXIT_STOPPED, steps=30, checkpoint=True, preempted=True)])
    environ = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1,node2", "SLURM_RESTART_COUNT": "0"}
    sup = Supervisor(run, plan, "42", slurm=Slurm(fake, clock), environ=environ)
    fake.signal_handler = sup.note_signal
    assert sup.drive() == EXIT_STOPPED and fake.state == "PENDING"
    (entry,) = audit.read(tmp_path)
    assert (entry["action"], entry["run"], entry["job_ids"], entry["by"]) == ("requeue", plan.run_name, ["42"], "driver")
    assert entry["reason"] == "stopped on a signal" and entry["exclude"] == [] and entry["config_hash"] == plan.config_hash


def test_a_driver_that_cannot_write_the_log_warns_and_goes_on(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "audit").write_text("a file where the audit folder belongs")
    audit.record_or_warn(tmp_path / "r", "requeue", job_ids=["42"])
    err = capsys.readouterr().err
    assert err.startswith(f"driver: could not record requeue in the audit log of {tmp_path}") and err.count("\n") == 1

