"""Roles on the lab, with real Unix users and groups (made here as root, removed after):
an outsider is refused by dtk and, with plain sbatch, by Slurm; a viewer reads a run and
its report but can neither change its config nor delete a checkpoint; a maintainer can; a
submitter removed from the group is refused at the next submit; the run root's audit log
names the right user for every action."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import access_support as acc
import lab_support
from conftest import REPO, require
from dtk.common import audit

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SUB, VIEW, MAINT, OUT = (f"{acc.PREFIX}-{r}" for r in ("sub", "view", "maint", "out"))
G_SUB, G_VIEW, G_MAINT = (f"{acc.PREFIX}-g{g}" for g in ("submit", "view", "maint"))
ACCOUNT = f"{acc.PREFIX}"
POLICY = f"""name: acctest
submitter: {{group: {G_SUB}, account: {ACCOUNT}}}
viewer: {{group: {G_VIEW}}}
maintainer: {{group: {G_MAINT}}}
"""
TRAIN = ["cluster=lab", "nodes=1", "tasks_per_node=1", "train.global_batch=16", "train.steps=12",
         "checkpoint.every=4", "checkpoint.keep=3", "train.log_every=4", "access=acctest",
         f"cluster.account={ACCOUNT}"]


@pytest.fixture(scope="module")
def team():
    """Users, groups, a project folder with the policy, the team folder, the lab enforcing it."""
    reason = lab_support.unavailable_reason()
    require(reason is None, f"the Slurm lab cannot run here: {reason}")
    require(shutil.which("useradd") is not None and shutil.which("runuser") is not None,
            "useradd and runuser (passwd, util-linux) are needed to make test users")
    lab_support.ensure_lab(3)
    acc.remove_all()
    base = Path(tempfile.mkdtemp(prefix="dtk-access-", dir="/tmp"))
    base.chmod(0o755)
    try:
        python = acc.user_python(base)
        require(python is not None, "no python that other users may run (and the system's python"
                                    f" {sys.version_info.major}.{sys.version_info.minor} is missing)")
        acc.make_users({SUB: [G_SUB, G_VIEW], VIEW: [G_VIEW], MAINT: [G_MAINT, G_VIEW], OUT: []})
        policy = base / "project" / "conf" / "access" / "acctest.yaml"
        policy.parent.mkdir(parents=True)
        policy.write_text(POLICY)
        acc.run(["chmod", "-R", "a+rX", str(base / "project")])
        env = {"DTK_CONFIG_PATH": str(base / "project")}
        root_cmd = [python, "-m"]
        acc.run(["env", *(f"{k}={v}" for k, v in env.items()), *root_cmd, "dtk.access", "prepare",
                 str(base / "team"), "--policy", "acctest"])
        up = subprocess.run([python, "-m", "dtk.lab", "up", "--nodes", "3", "--access", str(policy)],
                            cwd=REPO, capture_output=True, text=True, check=False)
        assert up.returncode == 0, up.stdout + up.stderr
        yield {"base": base, "python": python, "env": env, "runs": base / "team" / "runs"}
    finally:
        subprocess.run([sys.executable, "-m", "dtk.lab", "up", "--nodes", "3", "--access", "open"], cwd=REPO,
                       capture_output=True, check=False)  # the partitions admit everyone again
        acc.remove_all()
        shutil.rmtree(base, ignore_errors=True)


def dtk_as(team, user: str, *args: str) -> subprocess.CompletedProcess:
    return acc.as_user(user, [team["python"], "-m", *args], cwd=team["base"], env=team["env"])


def submit_as(team, user: str, *extra: str) -> subprocess.CompletedProcess:
    return dtk_as(team, user, "dtk.submit", *TRAIN, f"run.root={team['runs']}", "submit.wait=true", *extra)


def plain_sbatch(team, user: str) -> subprocess.CompletedProcess:
    return acc.as_user(user, ["sbatch", "--parsable", "-p", "debug", "-o", "/dev/null", "--wrap", "true"],
                       cwd=team["base"])


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_roles_are_enforced_by_dtk_slurm_and_the_run_root(team):
    runs = team["runs"]
    # An outsider: dtk refuses, naming the group and how to join it; Slurm refuses plain sbatch.
    out = submit_as(team, OUT)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith(f"error: user {OUT} may not submit training: not in group {G_SUB}")
    assert f"gpasswd -a {OUT} {G_SUB}" in out.stderr
    assert sorted(p.name for p in runs.iterdir()) == ["audit", "audit.head"]
    bypass = plain_sbatch(team, OUT)
    assert bypass.returncode != 0 and "error" in bypass.stderr, bypass.stdout + bypass.stderr

    # The submitter trains a run; its directory belongs to the maintainers, group-writable.
    sub = submit_as(team, SUB)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    (run,) = [p for p in runs.iterdir() if p.is_dir() and p.name != "audit"]
    assert run.stat().st_uid == pwd.getpwnam(SUB).pw_uid
    assert grp.getgrgid(run.stat().st_gid).gr_name == G_MAINT and run.stat().st_mode & stat.S_ISGID
    assert mode(run / "config.yaml") == 0o444
    steps = sorted((run / "checkpoints").glob("step_*"))
    assert len(steps) == 3 and all(mode(s) & 0o070 == 0o070 for s in steps), [oct(mode(s)) for s in steps]
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"

    # An outsider cannot even look: one error line, not a traceback.
    peek = dtk_as(team, OUT, "dtk.status", str(run))
    assert peek.returncode == 2 and peek.stderr.startswith("error: ") and "permission denied" in peek.stderr.lower()
    assert len(peek.stderr.strip().splitlines()) == 1, peek.stderr

    # A viewer reads the run and its report, and can neither change the config nor delete a checkpoint.
    status = dtk_as(team, VIEW, "dtk.status", str(run), "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "finished", status.stderr
    plots = team["base"] / "viewer-report"
    plots.mkdir()
    shutil.chown(plots, VIEW)
    report = dtk_as(team, VIEW, "dtk.report", str(run), "--out", str(plots))
    assert report.returncode == 0, report.stderr
    assert "final loss" in report.stdout or "loss" in report.stdout
    assert sorted(p.name for p in plots.glob("*.png"))
    export = dtk_as(team, VIEW, "dtk.checkpoint", "export", str(run), "--out", str(plots / "model.pt"))
    assert export.returncode == 0, export.stderr
    edit = acc.as_user(VIEW, ["sh", "-c", f"echo 'train: {{steps: 1}}' >> {run}/config.yaml"], cwd=team["base"])
    assert edit.returncode != 0
    swap = acc.as_user(VIEW, ["sh", "-c", f"cp {run}/config.yaml /tmp/{VIEW}-c && mv -f /tmp/{VIEW}-c {run}/config.yaml"],
                       cwd=team["base"])
    assert swap.returncode != 0
    delete = dtk_as(team, VIEW, "dtk.checkpoint", "delete", str(run), "--step", "4")
    assert delete.returncode == 2 and f"not in group {G_MAINT}, the maintainer role" in delete.stderr, delete.stderr
    rm = acc.as_user(VIEW, ["rm", "-rf", str(steps[0])], cwd=team["base"])
    assert rm.returncode != 0 and steps[0].is_dir()

    # A maintainer can do both.
    new_config = (run / "config.yaml").read_text().replace("log_every: 4", "log_every: 5")
    fix = subprocess.run(["runuser", "-u", MAINT, "--", "sh", "-c", f"cat > {run}/.c && mv -f {run}/.c {run}/config.yaml"],
                         input=new_config, capture_output=True, text=True, cwd=team["base"], check=False)
    assert fix.returncode == 0, fix.stderr
    assert "log_every: 5" in (run / "config.yaml").read_text()
    delete = dtk_as(team, MAINT, "dtk.checkpoint", "delete", str(run), "--step", "4")
    assert delete.returncode == 0, delete.stderr
    assert not steps[0].exists() and steps[1].is_dir()

    # A submitter removed from the group is refused at the next submit, by dtk and by Slurm.
    acc.run(["gpasswd", "-d", SUB, G_SUB])
    again = submit_as(team, SUB, "train.steps=16")
    assert again.returncode == 2 and f"not in group {G_SUB}" in again.stderr, again.stdout + again.stderr
    deadline = time.monotonic() + 40  # Slurm re-reads groups every GroupUpdateTime (10 s)
    while (bypass := plain_sbatch(team, SUB)).returncode == 0 and time.monotonic() < deadline:
        subprocess.run(["scancel", bypass.stdout.strip()], check=False)
        time.sleep(3)
    assert bypass.returncode != 0 and "not permitted" in bypass.stderr, bypass.stdout + bypass.stderr

    # The audit log names the right user for each action.
    checked = audit.verify(runs)
    assert checked.problems == [], checked.problems
    log = checked.entries
    seen = [(e["action"], e["user"]["name"]) for e in log]
    assert seen == [("submit", SUB), ("export", VIEW), ("delete_checkpoint", MAINT)], seen
    plan = json.loads((run / "plan.json").read_text())
    assert log[0]["config_hash"] == plan["config_hash"] and log[0]["job_ids"] and log[0]["run"] == run.name
    assert all(e["user"]["uid"] == pwd.getpwnam(e["user"]["name"]).pw_uid for e in log)
    assert (log[2]["step"], log[1]["step"]) == (4, 12)


def test_an_up_that_restarts_a_dead_node_keeps_the_policy(team, tmp_path):
    """docs/lab.md's way back for a killed slurmd (`lab up --nodes N`) opens no partition;
    an outsider who bypasses the policy is told he is not admitted, not "no such partition"."""
    from dtk import lab
    from dtk.lab import daemons

    record = lab.status().record
    (slurmd,) = [d for d in record.daemons if d.label == "slurmd node2"]
    os.kill(slurmd.pid, signal.SIGKILL)  # a slurmd this lab started
    deadline = time.monotonic() + 10
    while daemons.is_alive(slurmd) and time.monotonic() < deadline:
        time.sleep(0.1)
    up = subprocess.run([team["python"], "-m", "dtk.lab", "up", "--nodes", "3"], cwd=REPO, capture_output=True,
                        text=True, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert up.returncode == 0, up.stdout + up.stderr
    assert "restarting slurmd node2" in up.stdout and "access: the lab keeps policy acctest" in up.stdout, up.stdout
    assert "admit every user" not in up.stdout
    shown = subprocess.run([team["python"], "-m", "dtk.lab", "status"], cwd=REPO, capture_output=True, text=True,
                           check=False, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert "access: policy acctest" in shown, shown
    bypass = plain_sbatch(team, OUT)  # refused by the partition's groups or its account, as before the restart
    assert bypass.returncode != 0 and "error" in bypass.stderr, bypass.stdout + bypass.stderr
    own = team["base"] / f"{OUT}-runs"
    own.mkdir()
    shutil.chown(own, OUT)
    err = dtk_as(team, OUT, "dtk.submit", "cluster=lab", "nodes=1", "tasks_per_node=1", "train.steps=2",
                 f"run.root={own}")
    assert err.returncode == 2, err.stdout + err.stderr
    assert err.stderr.startswith(f"error: cluster.partition=debug: user {OUT} is not admitted to partition debug"
                                 f" (it admits groups {G_SUB}"), err.stderr
    assert "partitions you may use: none" in err.stderr and list(own.iterdir()) == []
