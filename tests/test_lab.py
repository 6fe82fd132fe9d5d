"""The lab: a real Slurm cluster on this machine (python -m dtk.lab up/status/down).

The tests marked `slurm` start real daemons and need root and slurm-wlm; the others check
the rendered files and the CLI's error path anywhere.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import traceback

import pytest

from conftest import dtk
from dtk import lab
from dtk.common.errors import run_cli
from dtk.lab import daemons, files, ownership
from dtk.lab.__main__ import main as lab_main
from lab_support import end_process_tree, ensure_lab, lab_down, named_process, unavailable_reason

NOBODY = 65534


def run_lab(*args: str) -> subprocess.CompletedProcess:
    """`python -m dtk.lab ARGS` as a user would type it."""
    return dtk("dtk.lab", *args, timeout=120)


def run_as_nobody(argv: list[str]) -> tuple[int, str]:
    """Run the lab CLI's main in a forked child that has dropped to user nobody.

    Forked rather than `setpriv ... python -m dtk.lab`: the interpreter may live where
    nobody cannot read it (here, under /root), and a child that already holds the code in
    memory needs no file access to reach the permission check."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 99
        try:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            os.dup2(write_end, 2)
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 (lives until _exit)
            run_cli(lab_main, argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as stderr:
        text = stderr.read()
    _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status), text


# -- anywhere: rendering and CLI errors ---------------------------------------------------

def test_conf_has_partitions_nodes_and_lab_paths(tmp_path):
    layout = files.LabLayout(tmp_path)
    conf = files.render_slurm_conf(layout, 16)
    assert conf.splitlines()[0] == files.CONF_HEADER
    assert "NodeName=node[1-16] NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001-17016 CPUs=2" in conf
    assert "PartitionName=debug Nodes=ALL Default=YES PriorityTier=1" in conf
    assert "PartitionName=high Nodes=ALL PriorityTier=10" in conf
    assert "PreemptType=preempt/partition_prio" in conf and "PreemptMode=REQUEUE" in conf
    assert f"StateSaveLocation={tmp_path}/state" in conf
    assert f"SlurmdSpoolDir={tmp_path}/spool/%n" in conf
    assert "$" not in conf  # every template variable was substituted
    cancel = files.render_slurm_conf(layout, 16, preempt_mode="cancel")  # dtk.lab up --preempt-mode cancel
    assert "\nPreemptMode=CANCEL\n" in cancel and cancel.replace("=CANCEL", "=REQUEUE") == conf


def test_conf_for_one_node_names_a_single_port(tmp_path):
    conf = files.render_slurm_conf(files.LabLayout(tmp_path), 1)
    assert "NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001 " in conf


def test_only_absent_or_dtk_written_conf_is_ours(tmp_path):
    conf = tmp_path / "slurm.conf"
    assert files.is_ours(conf)
    conf.write_text("ClusterName=site\n")
    assert not files.is_ours(conf)
    files.write_system_conf(files.render_slurm_conf(files.LabLayout(tmp_path), 2), conf)
    assert files.is_ours(conf)


def test_hosts_line_is_replaced_not_repeated():
    text = "127.0.0.1 localhost\n::1 ip6-localhost\n"
    three = files.hosts_with_lab_line(text, 3)
    assert three.endswith(f"127.0.0.1 node1 node2 node3 {files.HOSTS_MARK}\n")
    two = files.hosts_with_lab_line(three, 2)
    assert two == files.hosts_with_lab_line(text, 2)
    assert two.startswith(text) and two.count(files.HOSTS_MARK) == 1


def test_node_count_out_of_range_is_a_user_error():
    result = run_lab("up", "--nodes", "0")
    assert result.returncode == 2
    assert result.stderr.startswith("error: --nodes=0") and "Traceback" not in result.stderr


def test_login_node_path_stays_light():
    heavy = ("torch", "hydra", "omegaconf")
    code = f"import sys, dtk.lab.__main__; print([m for m in {heavy!r} if m in sys.modules])"
    result = dtk("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# -- on a real lab ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def lab_up():
    """The lab with 3 nodes for this module; whatever ran before is restored after."""
    reason = unavailable_reason()
    before = lab.status() if reason is None else None
    yield ensure_lab(3)
    if before is not None and before.up:
        ensure_lab(before.num_nodes)
    else:
        lab_down()


@pytest.mark.slurm
@pytest.mark.slow  # restarts the shared lab: not for the quick tier
def test_status_shows_every_node_and_daemon(lab_up):
    result = run_lab("status")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lab: up; 3 nodes" in result.stdout
    assert "debug*" in result.stdout and "high" in result.stdout
    # sinfo groups nodes by state (`node[1-3]` idle, or `node[1,3]` mix + `node2` idle):
    # the NODES column of the debug partition adds up to all of them, whatever their state.
    debug_rows = [line.split() for line in result.stdout.splitlines() if line.startswith("debug*")]
    assert sum(int(row[3]) for row in debug_rows) == 3, result.stdout
    for label in ("slurmctld", "slurmd node1", "slurmd node2", "slurmd node3"):
        assert any(line.split("pid")[0].strip() == label and line.endswith("alive")
                   for line in result.stdout.splitlines()), label


@pytest.mark.slurm
@pytest.mark.slow  # restarts the shared lab: not for the quick tier
def test_up_again_changes_nothing(lab_up):
    pids = [d.pid for d in lab.status().record.daemons]
    result = run_lab("up", "--nodes", "3", "--no-install")
    assert result.returncode == 0, result.stderr
    assert "already up with 3 nodes" in result.stdout
    assert [d.pid for d in lab.status().record.daemons] == pids


@pytest.mark.slurm
@pytest.mark.slow  # restarts the shared lab: not for the quick tier
def test_srun_runs_one_task_on_each_of_two_nodes(lab_up):
    result = subprocess.run(["srun", "-N", "2", "--ntasks-per-node=1", "bash", "-c", "echo $SLURMD_NODENAME"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    nodes = sorted(result.stdout.split())
    assert len(set(nodes)) == 2 and set(nodes) <= {"node1", "node2", "node3"}


@pytest.mark.slurm
@pytest.mark.slow  # restarts the shared lab: not for the quick tier
def test_two_node_batch_job_completes(lab_up, tmp_path):
    out = tmp_path / "job.out"
    submitted = subprocess.run(["sbatch", "--parsable", "-N", "2", "-o", str(out),
                                "--wrap", "srun bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME'"],
                               capture_output=True, text=True, timeout=30, check=True)
    assert wait_for_job(submitted.stdout.strip()) == "COMPLETED"
    lines = sorted(line.split() for line in out.read_text().splitlines())
    assert [rank for rank, _ in lines] == ["0", "1"]
    assert len({node for _, node in lines}) == 2


def wait_for_job(job_id: str, timeout_s: float = 60.0) -> str:
    """The job's final state. Polls scontrol: `sbatch --wait` polls only every few seconds
    and there is no sacct on the lab."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                               text=True, check=True).stdout
        state = shown.split("JobState=")[1].split()[0]
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {state} after {timeout_s:.0f} s")


@pytest.mark.slurm
@pytest.mark.slow  # restarts the shared lab: not for the quick tier
def test_sixteen_nodes_come_up_and_run_a_step(lab_up):
    try:
        assert ensure_lab(16).up
        result = subprocess.run(["srun", "-N", "16", "hostname"], capture_output=True,
                                text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr
        assert len(result.stdout.splitlines()) == 16
    finally:
        ensure_lab(3)


@pytest.mark.slurm
@pytest.mark.slow  # restarts the shared lab: not for the quick tier
def test_up_as_non_root_is_refused(lab_up):
    code, stderr = run_as_nobody(["up", "--nodes", "3"])
    assert code == 2, stderr
    assert stderr.startswith("error:") and "root" in stderr and "Traceback" not in stderr


@pytest.mark.slurm
@pytest.mark.slow  # restarts the shared lab: not for the quick tier
def test_down_leaves_no_lab_daemon(lab_up):
    started = lab.status().record.daemons
    result = run_lab("down")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("lab is down")
    assert not [d.label for d in started if daemons.is_alive(d)]
    left = ownership.census(lab.status().layout, None)
    assert not left.ours and not left.steps
    assert run_lab("status").returncode == 1
    ensure_lab(3)  # back up, so that the order of these tests does not matter


def submit_sleeper(tmp_path, run_dir: str) -> str:
    """A batch job that holds node1 (the script exports DTK_RUN_DIR, as dtk's do)."""
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\nexport DTK_RUN_DIR={shlex.quote(run_dir)}\nsleep 300\n")
    job = subprocess.run(["sbatch", "--parsable", "-N1", "-w", "node1", "-o", "/dev/null", "--job-name=dtk-demo",
                          str(script)], capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    deadline = time.monotonic() + 30
    while "JobState=RUNNING" not in subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                                                   text=True).stdout:
        assert time.monotonic() < deadline, f"job {job} did not start"
        time.sleep(0.2)
    return job


@pytest.mark.slurm
@pytest.mark.slow  # restarts the shared lab: not for the quick tier
def test_status_names_who_started_it_and_whose_jobs_run_and_down_refuses_them(lab_up, tmp_path):
    job = submit_sleeper(tmp_path, "/srv/runs/a b")
    try:
        shown = run_lab("status")
        assert shown.returncode == 0, shown.stderr
        assert "started by root on " in shown.stdout
        (line,) = [ln for ln in shown.stdout.splitlines() if ln.split()[:1] == [job]]
        assert line.split()[1:4] == ["root", "RUNNING", "node1"] and line.endswith("dtk-demo  (run /srv/runs/a b)")
        refused = run_lab("down")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stderr.startswith(f"error: stopping the lab would end 1 job(s) on the lab: {job} "
                                         "(root, RUNNING, run /srv/runs/a b)") and "--force" in refused.stderr
        restart = run_lab("up", "--nodes", "2", "--no-install")
        assert restart.returncode == 2 and "restarting the lab from 3 to 2 nodes would end 1 job" in restart.stderr
        assert lab.status().up and "JobState=RUNNING" in subprocess.run(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["scancel", job], capture_output=True)


@pytest.mark.slurm
@pytest.mark.slow  # restarts the shared lab: not for the quick tier
def test_down_force_ends_the_labs_jobs_and_no_other_process(lab_up, tmp_path):
    submit_sleeper(tmp_path, str(tmp_path / "run"))
    layout = lab.status().layout
    deadline = time.monotonic() + 30  # RUNNING is the controller's word; the node starts the step after it
    while True:
        steps = ownership.census(layout, lab.status().record).steps
        names = sorted(p.name() for p in steps)
        if (names.count("slurmstepd") >= 1 and "sleep" in names) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert names.count("slurmstepd") >= 1 and "sleep" in names, names  # found by the log it holds, not by name
    namesake = named_process(tmp_path, "slurmstepd")
    try:
        result = run_lab("down", "--force")
        assert result.returncode == 0, result.stderr
        assert f"killed {len(steps)} job processes" in result.stdout
        assert not [p.pid for p in steps if daemons.running(p)]
        assert namesake.poll() is None, "down stopped a slurmstepd that is not the lab's"
    finally:
        end_process_tree(namesake)
        ensure_lab(3)
