"""Access policies without the lab: reading them, the checks dtk makes before it acts, the
team folder's modes, and the lab's slurm.conf with a policy. Fast."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

import pytest

from access_support import remove_team
from conftest import require, run_main
from dtk.access import acl, check, layout, policy
from dtk.common.errors import UserError
from dtk.config.access import AccessConfig, RoleConfig, SubmitterConfig
from dtk.lab import files
from dtk.lab.access import with_access


def team_policy(**submitter) -> AccessConfig:
    return AccessConfig(name="t", submitter=SubmitterConfig(group="g-sub", **submitter),
                        viewer=RoleConfig(group="g-view"), maintainer=RoleConfig(group="g-maint"))


def test_policies_load_by_name_and_from_a_file(tmp_path):
    team = policy.load_policy("team")
    assert (team.name, team.submitter.group, team.viewer.group, team.maintainer.group) == \
        ("team", "dtk-submit", "dtk-view", "dtk-maint")
    assert not policy.enforced(policy.load_policy("open"))
    own = tmp_path / "mine.yaml"
    own.write_text("name: mine\nsubmitter: {group: a, account: acct}\nviewer: {group: b}\nmaintainer: {group: c}\n")
    assert policy.load_policy(str(own)).submitter.account == "acct"


@pytest.mark.parametrize("text, needle", [
    ("name: x\nsubmitter: {group: a}\n", "viewer.group, maintainer.group unset"),
    ("name: x\nsubmiter: {group: a}\n", "submiter"),
])
def test_a_bad_policy_is_one_error_line(tmp_path, text, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(UserError, match=needle):
        policy.load_policy(str(bad))
    proc = run_main("dtk.access", "show", str(bad))
    assert proc.returncode == 2 and proc.stderr.startswith("error: access policy") and needle in proc.stderr


def test_unknown_policy_names_the_ones_there_are():
    proc = run_main("dtk.access", "show", "nope")
    assert proc.returncode == 2
    assert "error: access policy nope: no such file" in proc.stderr and "open, team" in proc.stderr


def test_submit_check_names_the_group_and_how_to_join(monkeypatch, tmp_path):
    members = {"g-sub": {"alice"}, "g-view": {"alice", "bob"}, "g-maint": {"carol"}}
    monkeypatch.setattr(policy, "group_members", lambda g: members[g])
    monkeypatch.setattr(layout, "check_run_root", lambda root, p: None)
    kwargs = dict(run_dir=tmp_path / "run", cluster_kind="slurm", partition=None, account=None, qos=None)
    check.check_submit(team_policy(), user=policy.User(os.getuid(), "alice"), **kwargs)
    with pytest.raises(UserError) as err:
        check.check_submit(team_policy(), user=policy.User(1234, "bob"), **kwargs)
    text = str(err.value)
    assert "user bob may not submit training: not in group g-sub, the submitter role of access policy t" in text
    assert "gpasswd -a bob g-sub" in text
    with pytest.raises(UserError, match="cluster.account=None: access policy t has submitters use account acct;"
                                        " set cluster.account=acct"):
        check.check_submit(team_policy(account="acct"), user=policy.User(os.getuid(), "alice"), **kwargs)
    # The local cluster has no Slurm account to check.
    check.check_submit(team_policy(account="acct"), user=policy.User(os.getuid(), "alice"),
                       **{**kwargs, "cluster_kind": "local"})


def test_the_open_policy_checks_nothing(tmp_path):
    check.check_submit(policy.load_policy("open"), run_dir=tmp_path / "r", cluster_kind="slurm", partition=None,
                       account=None, qos=None, user=policy.User(99999, "nobody-at-all"))


def test_a_run_is_continued_by_the_user_who_started_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    layout.check_run_dir(run, os.stat(run).st_uid, "me")
    with pytest.raises(UserError, match="was started by user .*a run is continued by the user who started it"):
        layout.check_run_dir(run, os.stat(run).st_uid + 1, "someone")


def test_the_resolved_config_is_read_only_and_replaced_whole(tmp_path):
    path = tmp_path / "config.yaml"
    layout.write_readonly(path, "a: 1\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    inode = path.stat().st_ino
    layout.write_readonly(path, "a: 1\n")
    assert path.stat().st_ino == inode  # unchanged: not rewritten
    layout.write_readonly(path, "a: 2\n")
    assert path.read_text() == "a: 2\n" and stat.S_IMODE(path.stat().st_mode) == 0o444


def _three_groups() -> tuple[str, str, str]:
    names = [g.gr_name for g in grp.getgrall() if g.gr_name != "root"][:3]
    require(len(names) == 3, "three groups other than root are needed")
    return names[0], names[1], names[2]


def test_prepare_makes_the_team_folder_a_gate_and_the_run_root_the_maintainers(tmp_path):
    require(os.geteuid() == 0, "giving a folder another group needs root")
    sub, view, maint = _three_groups()
    pol = AccessConfig(name="t", submitter=SubmitterConfig(group=sub), viewer=RoleConfig(group=view),
                       maintainer=RoleConfig(group=maint))
    team = tmp_path / "team"
    shown = layout.prepare(team, pol, "name: t\n")
    assert len(shown) == 6
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    gname = lambda p: grp.getgrgid(p.stat().st_gid).gr_name  # noqa: E731
    assert (gname(team), mode(team)) == (view, 0o2750)
    assert (gname(team / "runs"), mode(team / "runs")) == (maint, 0o3775)
    fd = os.open(team / "runs", os.O_RDONLY)
    assert acl.named_groups(fd) == {grp.getgrnam(sub).gr_gid: 0o7}  # the submitters create run directories
    os.close(fd)
    assert (gname(team / "data"), mode(team / "data")) == (maint, 0o2775)
    assert (gname(team / "runs" / "audit"), mode(team / "runs" / "audit")) == (view, 0o3770)
    assert mode(team / "runs" / "audit.head") == 0o660 and acl.is_append_only(str(team / "runs" / "audit.head"))
    layout.check_run_root(team / "runs", pol)
    assert layout.recorded_policy(team / "runs") == "t"
    with pytest.raises(UserError, match="governed by access policy t"):
        check.check_submit(policy.load_policy("open"), run_dir=team / "runs" / "r", cluster_kind="local",
                           partition=None, account=None, qos=None)
    (team / "runs").chmod(0o777)
    with pytest.raises(UserError, match="not prepared for access policy t.*expected group .*setgid.*dtk.access prepare"):
        layout.check_run_root(team / "runs", pol)
    with pytest.raises(UserError, match="does not exist.*dtk.access prepare"):
        layout.check_run_root(tmp_path / "elsewhere" / "runs", pol)
    remove_team(team)


def test_lab_partitions_admit_the_submitter_group_and_account():
    base = files.render_slurm_conf(files.LabLayout(Path("/var/lib/dtk-lab")), 3)
    plain = with_access(base, team_policy(), accounts=False)
    parts = [ln for ln in plain.splitlines() if ln.startswith("PartitionName=")]
    assert len(parts) == 2 and all(ln.endswith(" AllowGroups=g-sub") for ln in parts)
    assert "GroupUpdateForce=1" in plain and "AccountingStorageType=accounting_storage/none" in plain
    charged = with_access(base, team_policy(account="acct"), accounts=True)
    assert all(ln.endswith(" AllowGroups=g-sub AllowAccounts=acct,root") for ln in charged.splitlines()
               if ln.startswith("PartitionName="))
    assert "AccountingStorageType=accounting_storage/slurmdbd" in charged
    assert "AccountingStorageEnforce=associations" in charged and "accounting_storage/none" not in charged


def test_a_file_the_user_may_not_read_is_one_error_line(capsys):
    from dtk.common.errors import run_cli

    def main(_argv):
        raise PermissionError(13, "Permission denied", "/shared/team/runs/r/plan.json")

    with pytest.raises(SystemExit) as done:
        run_cli(main, [])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: /shared/team/runs/r/plan.json: Permission denied for user ")


def test_lab_up_without_access_keeps_the_policy_in_force():
    from dtk.lab.access import kept

    said: list[str] = []
    state = {"policy": "team", "file": "/srv/conf/access/team.yaml", "group": "g-sub", "account": None}
    assert kept(None, state=state, log=said.append) == "/srv/conf/access/team.yaml"
    assert said == ["access: the lab keeps policy team (/srv/conf/access/team.yaml); python -m dtk.lab up"
                    " --access open admits every user again"]
    assert kept("open", state=state, log=said.append) == "open" and len(said) == 1  # told otherwise
    assert kept(None, state=None, log=said.append) is None  # a lab that was down, or open, starts open
