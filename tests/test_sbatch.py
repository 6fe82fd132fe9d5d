"""The sbatch text and the worker step's srun command are pure functions of the plan,
checked against golden files, also for a run directory whose path has spaces and quotes.

Regenerate after an intended change with `DTK_UPDATE_GOLDEN=1 python -m pytest tests/test_sbatch.py`
and review the diff. Nothing here needs Slurm: the executor test submits through a fake
`sbatch` on PATH, so this file runs (and never skips) on any machine.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_main
from dtk.common.errors import UserError
from dtk.config.compose import compose
from dtk.driver.supervisor import srun_command
from dtk.launch import slurmctl
from dtk.launch.sbatch import make_executor, parse_extra, sbatch_text, submit_command, submitit_folder
from dtk.plan.plan import make_plan

GOLDEN = Path(__file__).parent / "golden"
ROOT = "/shared/runs"  # absolute, so the text does not depend on where the test runs
# A project folder as people name them; run.root=runs is relative to it (submitit's
# weird_tmp_path habit: the script must quote every path it writes).
WEIRD_CWD = """/shared/Alice's project/my "big" runs"""
WEIRD_NAMES = ["a_0", "a 0", 'a"=0"', "a'; echo foo", r"a\=0", r"a\=", "a$HOME`id`"]


def normalize(text: str) -> str:
    return text.replace(sys.executable, "PYTHON")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DTK_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"sbatch text differs from {path}"


CASES = {
    "fsdp_16_nodes.sbatch": ["+scheme=fsdp", "nodes=16", "cluster=slurm"],
    "lab_2_nodes.sbatch": ["cluster=lab", "nodes=2", "tasks_per_node=1"],
    # 2 nodes x 8 GPUs with the generic cluster=slurm defaults: one GPU per task.
    "gpu_2x8.sbatch": ["cluster=slurm", "nodes=2"],
    # The GPU-shaped lab (python -m dtk.lab up --gpus-per-node 8), workers on the CPU.
    "gpu_lab_2x8.sbatch": ["cluster=lab", "nodes=2", "tasks_per_node=8", "cluster.gpus_per_node=8", "dist.device=cpu"],
    # A job that waits for two others to complete successfully (submit.after -> --dependency=afterok).
    "after_jobs.sbatch": ["cluster=lab", "nodes=1", "tasks_per_node=1", "submit.after=4711:4712"],
    "site_options.sbatch": [
        "cluster=slurm", "nodes=2", "cluster.partition=gpu", "cluster.account=proj-1", "cluster.qos=high",
        "cluster.constraint='a100&ib'", "cluster.mem_gb=480", "cluster.time_min=1440",
        "cluster.sbatch_extra=['--reservation=big','--mail-type=END']", "cluster.setup=[nccl,modules]",
    ],
}


def golden_plan(name: str):
    if name.startswith("weird_path"):
        return make_plan(compose(["cluster=lab", "nodes=2", "tasks_per_node=1", "run.root=runs", "run.name=golden"]),
                         cwd=WEIRD_CWD)
    return make_plan(compose([*CASES[name.split(".")[0] + ".sbatch"], f"run.root={ROOT}", "run.name=golden"]))


@pytest.mark.parametrize("name", [*sorted(CASES), "weird_path.sbatch"])
def test_sbatch_matches_golden(name):
    check_golden(name, normalize(sbatch_text(golden_plan(name))))


@pytest.mark.parametrize("name", ["fsdp_16_nodes.srun", "lab_2_nodes.srun", "weird_path.srun", "gpu_2x8.srun",
                                  "gpu_lab_2x8.srun"])
def test_worker_step_srun_command_matches_golden(name):
    """--cpus-per-task always (srun >= 22.05 does not inherit it); one GPU per task
    (--gpus-per-task=1) wherever each task has a GPU, unless cluster.gpu_bind names a binding."""
    plan = golden_plan(name)
    nodes = [f"node{i}" for i in range(1, plan.nodes + 1)]
    cmd = srun_command(plan, logs=Path(plan.run_dir) / "logs" / "start_00", nodes=nodes)
    check_golden(name, normalize(shlex.join(cmd)) + "\n")
    assert f"--cpus-per-task={plan.config.cluster.cpus_per_task}" in cmd
    assert ("--gpus-per-task=1" in cmd) == (plan.config.cluster.gpus_per_node > 0)
    assert not any(flag.startswith("--gpu-bind") for flag in cmd)


def test_a_site_binding_replaces_one_gpu_per_task():
    plan = make_plan(compose(["cluster=slurm", "nodes=2", "cluster.gpu_bind=closest", f"run.root={ROOT}",
                              "run.name=golden"]))
    cmd = srun_command(plan, logs=Path(plan.run_dir) / "logs", nodes=["a", "b"])
    assert "--gpu-bind=closest" in cmd and "--gpus-per-task=1" not in cmd
    cpu = make_plan(compose(["cluster=slurm", "nodes=1", "tasks_per_node=16", "dist.device=cpu", f"run.root={ROOT}",
                             "run.name=golden"]))
    assert not any("gpu" in flag for flag in srun_command(cpu, logs=Path("l"), nodes=["a"]))  # more tasks than GPUs


def bash(script: str) -> str:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("weird", WEIRD_NAMES)
def test_every_path_in_the_script_survives_the_shell(weird):
    plan = make_plan(compose(["cluster=lab", "run.root=runs", "run.name=r"]), cwd=f"/shared/{weird}")
    text = sbatch_text(plan)
    # The setup lines and the command, run by bash, see exactly the paths of the plan.
    setup = text.split("# setup\n", 1)[1].split("\n# command", 1)[0]
    assert bash(setup + 'printf %s "$DTK_RUN_DIR"') == plan.run_dir
    command = text.rstrip("\n").splitlines()[-1]
    argv = bash(f"set -- {command.split(' ', 1)[1]}; printf '%s\\0' \"$@\"").split("\0")[:-1]
    assert argv == ["-u", "-m", "submitit.core._submit", f"{plan.run_dir}/slurm/%j"]
    # sbatch reads #SBATCH values with the shell's quoting rules.
    output = next(ln for ln in text.splitlines() if ln.startswith("#SBATCH --output="))
    assert shlex.split(output.removeprefix("#SBATCH --output=")) == [f"{plan.run_dir}/slurm/%j/%j_0_log.out"]


def test_a_newline_in_the_run_directory_is_refused_before_anything_is_written():
    plan = make_plan(compose(["cluster=lab", "run.root=runs", "run.name=r"]), cwd="/shared/a\n0")
    with pytest.raises(UserError, match=r"run.root=runs: .*has a newline in its path"):
        sbatch_text(plan)


def test_dry_run_prints_the_fsdp_16_node_script_and_submits_nothing(tmp_path):
    proc = run_main("dtk.submit", "+scheme=fsdp", "nodes=16", "cluster=slurm", "submit.dry_run=true",
               f"run.root={ROOT}", "run.name=golden", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout.split("would submit this sbatch script:\n\n", 1)[1]
    assert normalize(script).rstrip("\n") == (GOLDEN / "fsdp_16_nodes.sbatch").read_text().rstrip("\n")
    assert "#SBATCH --nodes=16" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --ntasks-per-node=8" in script
    assert list(tmp_path.iterdir()) == [] and not Path(ROOT).exists()


FAKE_SBATCH = """#!/bin/sh
cp "$1" "$DTK_TEST_SUBMITTED"
echo "Submitted batch job 7"
"""


def test_executor_submits_the_script_the_dry_run_shows(tmp_path, monkeypatch):
    """A real submitit submission into a folder with spaces and quotes, to a fake sbatch
    that keeps the script it is given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", "#!/bin/sh\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DTK_TEST_SUBMITTED", str(tmp_path / "submitted.sh"))
    project = tmp_path / "Alice's project" / 'my "big" runs'
    plan = make_plan(compose(["cluster=lab", "nodes=2", "run.root=runs"]), cwd=project)

    job = make_executor(plan).submit(print, plan.run_dir)
    assert job.job_id == "7"
    submitted = (tmp_path / "submitted.sh").read_text()
    assert submitted == sbatch_text(plan)
    assert submitted.rstrip("\n").endswith(submit_command(submitit_folder(plan) / "%j"))
    assert (submitit_folder(plan) / "7" / "7_submitted.pkl").is_file()  # where _submit will look


@pytest.mark.parametrize("overrides, needle", [
    (["cluster=lab", "submit.after=soon"], "submit.after=soon: expected a Slurm job id, or several joined by ':'"),
    (["submit.after=4711"], "submit.after=4711: only a Slurm job can wait for another (cluster.kind=local)"),
])
def test_a_bad_dependency_is_refused_before_anything_is_written(tmp_path, overrides, needle):
    proc = run_main("dtk.submit", *overrides, f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {needle}")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_extra_flags_parse():
    assert parse_extra(["--reservation=big", "--mail-type END", "--overcommit"]) == {
        "reservation": "big", "mail-type": "END", "overcommit": True}
    with pytest.raises(UserError, match="not a long sbatch flag"):
        parse_extra(["-p gpu"])


PARTITIONS = """\
PartitionName=debug AllowGroups=ALL Default=YES MaxNodes=UNLIMITED MaxTime=UNLIMITED State=UP TotalCPUs=6 TotalNodes=3
PartitionName=short AllowGroups=ALL Default=NO MaxTime=00:30:00 State=UP TotalNodes=2
PartitionName=gone Default=NO MaxTime=1-00:00:00 State=DOWN TotalNodes=4
"""


def test_partition_checks_before_submission():
    parts = slurmctl.parse_partitions(PARTITIONS)
    assert [p.name for p in parts] == ["debug", "short", "gone"]
    assert parts[1].max_time_min == 30 and parts[2].max_time_min == 1440
    assert slurmctl.check_fits(parts, partition=None, nodes=3, time_min=600).name == "debug"
    with pytest.raises(UserError, match="cluster.partition=nope: no such partition .available: debug, short, gone"):
        slurmctl.check_fits(parts, partition="nope", nodes=1, time_min=10)
    with pytest.raises(UserError, match="nodes=3: partition short has only 2 node"):
        slurmctl.check_fits(parts, partition="short", nodes=3, time_min=10)
    with pytest.raises(UserError, match="cluster.time_min=60: partition short allows at most 30 minutes"):
        slurmctl.check_fits(parts, partition="short", nodes=1, time_min=60)
    with pytest.raises(UserError, match="DOWN"):
        slurmctl.check_fits(parts, partition="gone", nodes=1, time_min=10)
    # Spare nodes are asked for too: 2 + 1 spare do not fit a partition of 2.
    with pytest.raises(UserError, match=r"nodes=2 \+ spare_nodes=1 = 3: partition short has only 2 node"):
        slurmctl.check_fits(parts, partition="short", nodes=2, time_min=10, spare_nodes=1)


def test_exclude_from_file_leaves_its_nodes_out_of_the_sbatch(tmp_path):
    listed = tmp_path / "slow_nodes.txt"
    listed.write_text("# written by python -m dtk.doctor\nnode3  # p2p 4.1x the median\n\nnode1\n")
    proc = run_main("dtk.submit", "cluster=lab", "nodes=1", f"cluster.exclude_from={listed}", "submit.dry_run=true",
               f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --exclude=node1,node3" in proc.stdout
    missing = run_main("dtk.submit", "cluster=lab", f"cluster.exclude_from={tmp_path / 'nope.txt'}",
                  f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.startswith("error: cluster.exclude_from=")
    assert len(missing.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()
