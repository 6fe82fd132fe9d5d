"""Pure pieces of the drivers and the worker environment: no processes, no Slurm."""

from __future__ import annotations

import pytest

from dtk.common.rundir import RunDir
from dtk.config.compose import compose
from dtk.driver.exclusions import add_exclusions, read_exclusions
from dtk.driver.logs import failure_cause
from dtk.driver.resize import fit_plan
from dtk.launch.sbatch import SubmitInputs, sbatch_text, signal_lead
from dtk.launch.slurmctl import parse_time_min
from dtk.plan.plan import make_plan
from dtk.worker.env import read_env


def lab_plan(*overrides: str):
    return make_plan(compose(["cluster=lab", "nodes=4", "tasks_per_node=2", "train.global_batch=64",
                              "train.micro_batch=8", "run.root=/shared/runs", *overrides]))


def test_fit_plan_keeps_the_plan_when_enough_nodes_remain():
    plan = lab_plan()
    assert fit_plan(plan, 5, allow_shrink=True) is plan


def test_fit_plan_shrinks_data_parallel_keeping_the_global_batch():
    plan = lab_plan()
    small = fit_plan(plan, 2, allow_shrink=True)
    assert small.nodes == 2 and small.world_size == 4 and small.degrees.dp == 4
    assert small.global_batch == plan.global_batch == small.micro_batch * small.grad_accum * small.degrees.dp
    assert small.grad_accum == 2 * plan.grad_accum
    assert small.run_dir == plan.run_dir and small.config_hash == plan.config_hash


def test_fit_plan_picks_a_smaller_micro_batch_when_the_old_one_no_longer_divides():
    plan = lab_plan("train.global_batch=48", "train.micro_batch=6")  # dp 8: 48 = 6 x 1 x 8
    small = fit_plan(plan, 3, allow_shrink=True)  # dp 6: 48 / 6 = 8, micro 6 does not divide 8
    assert small is not None and small.degrees.dp == 6 and small.micro_batch == 4 and small.grad_accum == 2


def test_fit_plan_refuses_when_shrinking_is_off_or_the_layout_cannot_fit():
    assert fit_plan(lab_plan(), 2, allow_shrink=False) is None
    assert fit_plan(lab_plan("+scheme=ddp", "scheme.dp_replicate=8"), 2, allow_shrink=True) is None


def test_exclusions_accumulate_without_duplicates(tmp_path):
    run = RunDir(tmp_path)
    assert read_exclusions(run) == []
    add_exclusions(run, ["node2"], job_id="7", reason="left the job")
    add_exclusions(run, ["node2", "node5"], job_id="9", reason="left the job")
    assert read_exclusions(run) == ["node2", "node5"]


def test_excluded_nodes_and_lead_time_reach_the_sbatch_script():
    plan = lab_plan("spare_nodes=1")
    text = sbatch_text(plan, SubmitInputs(exclude=("node2", "node5"), signal_lead_s=95))
    assert "#SBATCH --exclude=node2,node5" in text
    assert "#SBATCH --signal=USR2@95" in text
    assert "#SBATCH --nodes=5" in text  # 4 + 1 spare
    assert "#SBATCH --no-kill" in text and "#SBATCH --requeue" in text


def test_signal_lead_is_save_plus_step_plus_margin_with_a_floor():
    assert signal_lead(floor_s=60, save_s=None, step_s=None) == 60
    assert signal_lead(floor_s=60, save_s=5.0, step_s=1.0) == 60
    assert signal_lead(floor_s=60, save_s=80.2, step_s=3.0) == 114


def test_failure_cause_names_the_first_rank_with_an_exception(tmp_path):
    (tmp_path / "rank_0.log").write_text("step 10/100\n")
    (tmp_path / "rank_1.log").write_text("Traceback (most recent call last):\n  ...\nValueError: model._target_ bad\n")
    (tmp_path / "rank_10.log").write_text("RuntimeError: later rank\n")
    assert failure_cause(tmp_path, 1) == "rank 1: ValueError: model._target_ bad"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "signal 9" in failure_cause(empty, 137)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, ("single", 0, 0, 1, 1, "127.0.0.1")),
        ({"DTK_RANK": "3", "DTK_WORLD_SIZE": "4", "DTK_LOCAL_WORLD_SIZE": "2", "DTK_MASTER_ADDR": "h"},
         ("dtk", 3, 1, 4, 2, "h")),
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "m"},
         ("torchrun", 5, 1, 8, 4, "m")),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
          "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_STEP_NODELIST": "gpu[07-09]"},
         ("slurm", 5, 1, 6, 2, "gpu07")),
    ],
)
def test_env_tables(env, expected):
    e = read_env(env)
    assert (e.source, e.rank, e.local_rank, e.world_size, e.local_world_size, e.master_addr) == expected


def test_slurm_time_formats():
    assert parse_time_min("UNLIMITED") is None
    assert parse_time_min("30") == 30
    assert parse_time_min("1:30:00") == 90
    assert parse_time_min("2-00:00:00") == 2880
