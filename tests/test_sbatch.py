"""The sbatch text is a pure function of the plan, checked against golden files.

Regenerate after an intended change with `DTK_UPDATE_GOLDEN=1 python -m pytest tests/test_sbatch.py`
and review the diff.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conftest import dtk
from dtk.config.compose import compose
from dtk.errors import UserError
from dtk.launch import slurmctl
from dtk.launch.sbatch import parse_extra, sbatch_text, submit_command, submitit_folder
from dtk.plan.plan import make_plan

GOLDEN = Path(__file__).parent / "golden"
ROOT = "/shared/runs"  # absolute, so the text does not depend on where the test runs


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
    # A job that waits for two others to complete successfully (submit.after -> --dependency=afterok).
    "after_jobs.sbatch": ["cluster=lab", "nodes=1", "tasks_per_node=1", "submit.after=4711:4712"],
    "site_options.sbatch": [
        "cluster=slurm", "nodes=2", "cluster.partition=gpu", "cluster.account=proj-1", "cluster.qos=high",
        "cluster.constraint='a100&ib'", "cluster.mem_gb=480", "cluster.time_min=1440",
        "cluster.sbatch_extra=['--reservation=big','--mail-type=END']", "cluster.setup=[nccl,modules]",
    ],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sbatch_matches_golden(name):
    plan = make_plan(compose([*CASES[name], f"run.root={ROOT}", "run.name=golden"]))
    check_golden(name, normalize(sbatch_text(plan)))


def test_dry_run_prints_the_fsdp_16_node_script_and_submits_nothing(tmp_path):
    proc = dtk("dtk.submit", "+scheme=fsdp", "nodes=16", "cluster=slurm", "submit.dry_run=true",
               f"run.root={ROOT}", "run.name=golden", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout.split("would submit this sbatch script:\n\n", 1)[1]
    assert normalize(script).rstrip("\n") == (GOLDEN / "fsdp_16_nodes.sbatch").read_text().rstrip("\n")
    assert "#SBATCH --nodes=16" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --ntasks-per-node=8" in script
    assert list(tmp_path.iterdir()) == [] and not Path(ROOT).exists()


def test_executor_submits_the_same_command_the_dry_run_shows():
    pytest.importorskip("submitit")
    import shutil

    if shutil.which("srun") is None:
        pytest.skip("submitit's Slurm executor needs srun on PATH")
    from dtk.launch.sbatch import make_executor

    plan = make_plan(compose(["cluster=lab", "nodes=2", f"run.root={ROOT}", "run.name=golden"]))
    executor = make_executor(plan)
    command = executor._submitit_command_str
    assert command == submit_command(submitit_folder(plan) / "%j")
    assert executor._make_submission_file_text(command, "uid") == sbatch_text(plan)


@pytest.mark.parametrize("overrides, needle", [
    (["cluster=lab", "submit.after=soon"], "submit.after=soon: expected a Slurm job id, or several joined by ':'"),
    (["submit.after=4711"], "submit.after=4711: only a Slurm job can wait for another (cluster.kind=local)"),
])
def test_a_bad_dependency_is_refused_before_anything_is_written(tmp_path, overrides, needle):
    proc = dtk("dtk.submit", *overrides, f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
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
