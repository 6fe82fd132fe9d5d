"""The team folder against its own members, with real Unix users and groups (made here as
root, removed after) and real files: `prepare` follows no link a member planted, a run root
below the team's is refused, a viewer can neither take a run's name nor forge or erase the
audit log. Fast: no training, no Slurm."""

from __future__ import annotations

import grp
import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

import access_support as acc
from conftest import dtk, require
from dtk.common import audit
from dtk.common.errors import UserError

PREFIX = "dtkteam"  # this module's users and groups (access_support.remove_all)
SUB, VIEW, MAINT = (f"{PREFIX}-{r}" for r in ("sub", "view", "maint"))
G_SUB, G_VIEW, G_MAINT = (f"{PREFIX}-g{g}" for g in ("submit", "view", "maint"))
POLICY = f"name: teamtest\nsubmitter: {{group: {G_SUB}}}\nviewer: {{group: {G_VIEW}}}\nmaintainer: {{group: {G_MAINT}}}\n"


@pytest.fixture(scope="module")
def team():
    require(os.geteuid() == 0, "making users, groups and a team folder needs root")
    require(shutil.which("useradd") is not None and shutil.which("runuser") is not None,
            "useradd and runuser (passwd, util-linux) are needed to make test users")
    acc.remove_all(PREFIX)
    base = Path(tempfile.mkdtemp(prefix="dtk-team-", dir="/tmp"))
    base.chmod(0o755)
    try:
        python = acc.user_python(base)
        require(python is not None, "no python that other users may run")
        acc.make_users({SUB: [G_SUB, G_VIEW], VIEW: [G_VIEW], MAINT: [G_MAINT, G_VIEW]})
        policy = base / "project" / "access" / "teamtest.yaml"
        policy.parent.mkdir(parents=True)
        policy.write_text(POLICY)
        acc.run(["chmod", "-R", "a+rX", str(base / "project")])
        prep = dtk("dtk.access", "prepare", str(base / "team"), "--policy", str(policy))
        assert prep.returncode == 0, prep.stderr
        yield {"base": base, "python": python, "policy": policy, "runs": base / "team" / "runs",
               "env": {"DTK_CONFIG_PATH": str(base / "project")}}
    finally:
        acc.remove_team(base / "team")
        acc.remove_all(PREFIX)
        shutil.rmtree(base, ignore_errors=True)


def sh(user: str, command: str, team) -> subprocess.CompletedProcess:
    return acc.as_user(user, ["sh", "-c", command], cwd=team["base"])


def dtk_as(team, user: str, *args: str) -> subprocess.CompletedProcess:
    return acc.as_user(user, [team["python"], "-m", *args], cwd=team["base"], env=team["env"])


def record_as(team, user: str, action: str, run: str, **details) -> None:
    code = (f"from dtk.common import audit; audit.record({str(team['runs'])!r}, {action!r}, run={run!r},"
            f" **{details!r})")
    proc = acc.as_user(user, [team["python"], "-c", code], cwd=team["base"], env=team["env"])
    assert proc.returncode == 0, proc.stderr


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def test_prepare_follows_no_link_a_member_planted(team, tmp_path):
    runs = team["runs"]
    victim = tmp_path / "shadow"  # stands for /etc/shadow: root's, private
    victim.write_text("root:secret\n")
    victim.chmod(0o600)
    before = victim.stat()
    # A maintainer may write the run root: plant the old audit log's name as a link.
    planted = sh(MAINT, f"ln -s {victim} {runs}/audit.jsonl", team)
    assert planted.returncode == 0, planted.stderr
    try:
        err = one_error_line(dtk("dtk.access", "prepare", str(runs.parent), "--policy", str(team["policy"])))
        assert f"{runs}/audit.jsonl is a symbolic link (-> {victim})" in err and "follows no link" in err
        after = victim.stat()
        assert (stat.S_IMODE(after.st_mode), after.st_gid, after.st_uid) == (0o600, before.st_gid, before.st_uid)
    finally:
        (runs / "audit.jsonl").unlink()
    # A folder prepare would change, planted as a link or as a file: refused, nothing followed.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    other = tmp_path / "other"
    other.mkdir()
    (other / "data").symlink_to(elsewhere)
    err = one_error_line(dtk("dtk.access", "prepare", str(other), "--policy", str(team["policy"])))
    assert f"{other}/data is a symbolic link" in err
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o700 and elsewhere.stat().st_gid == 0
    assert not (other / "runs").exists()  # refused before anything was made
    (other / "data").unlink()
    (other / "runs").write_text("")
    assert "runs is not a folder" in one_error_line(dtk("dtk.access", "prepare", str(other), "--policy",
                                                        str(team["policy"])))
    link = tmp_path / "team-link"
    link.symlink_to(elsewhere)
    assert "team-link is a symbolic link" in one_error_line(
        dtk("dtk.access", "prepare", str(link), "--policy", str(team["policy"])))
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o700
    # The real one repairs cleanly again.
    assert dtk("dtk.access", "prepare", str(runs.parent), "--policy", str(team["policy"])).returncode == 0


def test_a_viewer_cannot_create_rename_or_block_a_run_directory(team):
    runs = team["runs"]
    assert not runs.stat().st_mode & 0o002, oct(runs.stat().st_mode)  # not writable by others
    blocked = sh(VIEW, f"mkdir {runs}/{SUB}-next", team)
    assert blocked.returncode != 0 and not (runs / f"{SUB}-next").exists()
    made = sh(SUB, f"umask 002 && mkdir {runs}/{SUB}-next", team)
    assert made.returncode == 0, made.stderr
    run = runs / f"{SUB}-next"
    assert grp.getgrgid(run.stat().st_gid).gr_name == G_MAINT and run.stat().st_mode & stat.S_ISGID
    assert sh(VIEW, f"mv {run} {runs}/taken", team).returncode != 0 and run.is_dir()
    assert sh(VIEW, f"ls {run}", team).returncode == 0  # a viewer still reads
    assert sh(MAINT, f"touch {run}/by-maintainer", team).returncode == 0  # maintainers write runs
    assert sh(MAINT, f"mv {run} {runs}/renamed", team).returncode != 0  # but rename no one's run (sticky)


def test_a_run_root_below_the_team_run_root_is_refused(team):
    runs = team["runs"]
    nested = runs / "nested"
    assert sh(SUB, f"umask 002 && mkdir -p {nested}/r1", team).returncode == 0
    (nested / "r1" / "plan.json").write_text(json.dumps({"run_name": "r1", "config_hash": "0", "steps": 2}))
    try:
        err = one_error_line(dtk_as(team, SUB, "dtk.submit", "access=teamtest", f"run.root={nested}", "train.steps=2"))
        assert f"is inside the team folder {runs.parent}" in err and f"set run.root={runs}" in err, err
        err = one_error_line(dtk_as(team, SUB, "dtk.submit", "access=open", f"run.root={nested}", "train.steps=2"))
        assert "is governed by access policy teamtest" in err, err
        assert sorted(p.name for p in nested.iterdir()) == ["r1"]  # nothing written
        err = one_error_line(dtk_as(team, SUB, "dtk.stop", str(nested / "r1")))
        assert f"run.root={nested} is inside the team folder" in err
    finally:
        shutil.rmtree(nested)


def test_a_viewer_cannot_forge_or_erase_the_audit_log(team):
    runs = team["runs"]
    run = runs / "audited"
    assert sh(SUB, f"umask 002 && mkdir {run}", team).returncode == 0
    (run / "plan.json").write_text(json.dumps({"run_name": "audited", "config_hash": "abc", "steps": 30}))
    start = len(audit.verify(runs).entries)
    record_as(team, SUB, "submit", "audited", job_ids=["7"])
    record_as(team, VIEW, "export", "audited", step=4)
    folder = runs / audit.AUDIT_DIR
    first, second = (folder / f"{n:08d}.json" for n in (start + 1, start + 2))
    # The viewer forges a delete under the maintainer's name, chained correctly.
    forged = {"seq": start + 3, "prev": audit._digest(second.read_bytes()), "time": "2026-01-01T00:00:00Z",
              "user": {"uid": int(acc.run(["id", "-u", MAINT]).stdout), "name": MAINT}, "host": "x",
              "action": "delete_checkpoint", "run": "audited", "config_hash": "abc", "job_ids": [], "step": 4}
    text = json.dumps(forged).replace("'", "")
    assert sh(VIEW, f"printf '%s\\n' '{text}' > {folder}/{start + 3:08d}.json", team).returncode == 0
    # ... and tries to erase the submitter's entry and the head.
    assert sh(VIEW, f"rm -f {first}", team).returncode != 0 and first.is_file()
    assert sh(VIEW, f": > {first}", team).returncode != 0
    assert sh(VIEW, f": > {runs}/audit.head", team).returncode != 0  # append-only: no truncation
    assert sh(VIEW, f"rm -f {runs}/audit.head", team).returncode != 0
    status = dtk_as(team, VIEW, "dtk.status", str(run), "--json")
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert [(e["action"], e["user"]["name"]) for e in info["audit"]] == [("submit", SUB), ("export", VIEW)]
    assert any(f"entry {start + 3} is forged" in p and f"written by {VIEW}" in p for p in info["audit_problems"])
    shown = dtk_as(team, VIEW, "dtk.status", str(run)).stdout
    assert "NOT INTACT" in shown and "delete_checkpoint" not in shown.split("NOT INTACT")[0]
    checked = dtk_as(team, VIEW, "dtk.access", "audit", str(runs))
    assert checked.returncode == 1 and "forged" in checked.stdout, checked.stdout + checked.stderr
    # The viewer removes the forgery and his own export: the chain and the head show it.
    assert sh(VIEW, f"rm -f {folder}/{start + 3:08d}.json {second}", team).returncode == 0
    record_as(team, MAINT, "delete_checkpoint", "audited", step=4)
    problems = audit.verify(runs).problems
    assert any("removed" in p for p in problems), problems
    assert dtk_as(team, VIEW, "dtk.access", "audit", str(runs.parent)).returncode == 1


def test_refusals_say_what_the_user_holds_and_what_would_work(team):
    from dtk.access import check, policy
    from dtk.launch import slurmctl

    runs = team["runs"]
    run = runs / "refusals"
    assert sh(SUB, f"umask 002 && mkdir {run}", team).returncode == 0
    (run / "plan.json").write_text(json.dumps({"run_name": "refusals", "config_hash": "abc", "steps": 30}))
    # A viewer's report without --out: pointed to --out, not told he lacks the viewer role.
    err = one_error_line(dtk_as(team, VIEW, "dtk.report", str(run)))
    assert f"cannot write the plots into {run}/report as user {VIEW}" in err and "--out DIR" in err, err
    assert "viewer role" not in err and not (run / "report").exists()
    # A role that is not Slurm's to check: no Slurm hint.
    err = one_error_line(dtk_as(team, VIEW, "dtk.checkpoint", "delete", str(run), "--step", "4"))
    assert f"not in group {G_MAINT}, the maintainer role" in err and "slurm" not in err.lower(), err
    err = one_error_line(dtk_as(team, VIEW, "dtk.stop", str(run)))
    assert f"not in group {G_SUB}, the submitter role" in err and "Slurm's partitions" in err, err
    # A partition that admits another group (Slurm hides it from this user): "not admitted".
    parts = slurmctl.parse_partitions(
        f"PartitionName=debug Default=YES TotalNodes=3 MaxTime=UNLIMITED State=UP AllowGroups={G_SUB}\n"
        "PartitionName=high Default=NO TotalNodes=3 MaxTime=UNLIMITED State=UP AllowGroups=ALL\n")
    viewer = policy.User(int(acc.run(["id", "-u", VIEW]).stdout), VIEW)
    pol = policy.load_policy(str(team["policy"]))
    with pytest.raises(UserError) as refused:
        check.check_admitted(parts, partition=None, policy=pol, user=viewer)
    text = str(refused.value)
    assert f"user {VIEW} is not admitted to partition debug (it admits groups {G_SUB}" in text, text
    assert "you hold viewer" in text and "partitions you may use: high" in text and "no such partition" not in text
    check.check_admitted(parts, partition="high", policy=pol, user=viewer)
    check.check_admitted(parts, partition=None, policy=pol, user=policy.User(int(acc.run(["id", "-u", SUB]).stdout), SUB))
