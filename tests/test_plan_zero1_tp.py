"""ZeRO-1 (the optimizer state sharded over the data-parallel ranks, Megatron-LM's
distributed optimizer) combined with tensor and pipeline parallelism: python -m dtk.plan
expresses and budgets it, and the workers run it (no DDP wrapper: the optimizer all-reduces)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import run_main
from dtk.plan.degrees import Degrees

# Megatron-LM SC'21 Table 1's 145.6B layout: t=8, p=8, 24 replicas, on 192 nodes of 8 A100s
LAYOUT = ["cluster=slurm", "tasks_per_node=8", "nodes=192", "cluster.accelerator=a100-80gb", "cluster.nics_per_node=8",
          "train.global_batch=2304", "plan.layers=80", "plan.hidden=12288", "plan.heads=96", "plan.seq_len=2048",
          "plan.vocab_size=51200", "+scheme=hybrid", "scheme.dp_replicate=24", "scheme.dp_shard=1", "scheme.tp=8",
          "scheme.pp=8", "scheme.activation_checkpoint=full", "train.micro_batch=1"]
ZERO1 = ["scheme.data_parallel=ddp", "scheme.shard_optimizer=true"]


def _plan(tmp_path, *extra: str) -> dict:
    r = run_main("dtk.plan", *LAYOUT, *extra, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_the_plan_budgets_zero1_with_tp_and_pp_its_optimizer_state_sharded_over_dp(tmp_path):
    replicas, zero1 = _plan(tmp_path), _plan(tmp_path, *ZERO1)
    before, after = replicas["per_device_bytes"], zero1["per_device_bytes"]
    assert after["params"] == before["params"] and after["grads"] == before["grads"]
    assert abs(after["optimizer"] * 24 / before["optimizer"] - 1) < 0.001
    assert zero1["fits"] is True
    assert zero1["plan"]["degrees"] == dataclasses.asdict(Degrees(dp_replicate=24, pp=8, dp_shard=1, tp=8))
    # the parameters' broadcast of ZeRO-1 travels on the data-parallel axis
    assert any("ZeRO-1" in a["what"] for a in zero1["comm"] if a["axis"] == "dp_replicate")
    # DDP with tp and the optimizer state not sharded is no layout the planner knows either
    r = run_main("dtk.plan", *LAYOUT, "scheme.data_parallel=ddp", cwd=tmp_path)
    assert r.returncode == 2 and "DDP replicates whole" in r.stderr


def test_the_workers_plan_accepts_it_as_the_planner_does(tmp_path):
    """dtk.submit's plan (not the planner's) takes ZeRO-1 with tp: the runtime runs it
    (+scheme=zero_tp_pp, tests/test_schemes_zero_tp_pp.py)."""
    from dtk.config.compose import compose
    from dtk.plan.layout import uses_zero1, zero1_reduces_gradients
    from dtk.plan.plan import make_plan

    job = ["tasks_per_node=4", "+scheme=hybrid", "scheme.dp_replicate=2", "scheme.dp_shard=1", "scheme.tp=2",
           "scheme.pp=1", *ZERO1]
    plan = make_plan(compose(job), cwd=str(tmp_path))
    assert uses_zero1(plan.config.scheme, plan.degrees) and zero1_reduces_gradients(plan.config.scheme, plan.degrees)
    assert run_main("dtk.plan", *job, cwd=tmp_path).returncode == 0
