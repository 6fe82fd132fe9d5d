"""The planner's numbers reach the workers in the plan (plan.json's `memory`, made at
submission by dtk.plan.cost.gate.planned_memory) instead of each rank running the budget again:
the worker's import path holds no budget module, and the figures a worker compares are the
budget's for its rank."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from dtk.config.compose import compose
from dtk.parallel.count import real_shape
from dtk.plan.cost.gate import check, planned_memory
from dtk.plan.cost.predict import comparable, figures, rank_prediction
from dtk.plan.plan import Plan, make_plan
from dtk.worker.memory import Prediction

BUDGET = ("dtk.plan.cost.budget", "dtk.plan.cost.memory", "dtk.plan.cost.predict", "dtk.plan.cost.report", "dtk.plan.cost.inputs",
          "dtk.plan.cost.steptime", "dtk.plan.cost.comm", "dtk.plan.cost.search", "dtk.plan.cost.variants", "dtk.plan.sync",
          "dtk.plan.cost.activations", "dtk.plan.cost.gate", "dtk.launch.sbatch")
SMALL = ["model.dim=64", "model.num_layers=2", "model.num_heads=4", "model.seq_len=32", "model.vocab_size=256",
         "train.global_batch=8", "tasks_per_node=2", "dist.device=cpu"]


@pytest.mark.slow
def test_the_workers_import_path_holds_no_budget_and_no_sbatch_renderer():
    code = "import sys, json, dtk.worker.main; print(json.dumps(sorted(m for m in sys.modules if m.startswith('dtk.'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(json.loads(out))
    assert "dtk.worker.main" in loaded and "dtk.plan.planned_memory" in loaded
    assert sorted(loaded & set(BUDGET)) == []


def _submitted(*overrides: str) -> tuple[Plan, Plan]:
    """The plan as make_plan gives it, and as the submission hands it to the workers (plan.json)."""
    cfg = compose([*SMALL, *overrides])
    plan = make_plan(cfg, cwd="/tmp")
    handed = dataclasses.replace(plan, memory=planned_memory(cfg, plan, check(cfg, plan)))
    return plan, Plan.from_json(handed.to_json())


def test_the_planned_figures_reach_the_workers_comparison():
    plan, handed = _submitted("+scheme=fsdp")
    shape = real_shape(plan.config)
    for rank in range(plan.world_size):
        prediction = Prediction(handed, rank=rank, device=torch.device("cpu"))
        budget = rank_prediction(plan.config, plan, shape, rank=rank, device="cpu")  # what a worker ran before
        assert prediction.error is None and prediction.figures == figures(budget)
        assert prediction.activations_estimated
        assert comparable(budget, "cpu") > 0


def test_a_start_of_another_world_or_device_records_why_it_has_no_figures():
    plan, handed = _submitted("+scheme=ddp")
    assert set(handed.memory["devices"]) == {"cpu"}  # dist.device=cpu: one kind planned
    on_gpu = Prediction(handed, rank=0, device=torch.device("cuda"))
    assert on_gpu.figures is None and on_gpu.error == "the memory was planned for cpu; this rank runs on cuda"
    resized = dataclasses.replace(handed, world_size=1, tasks_per_node=1)
    off = Prediction(resized, rank=0, device=torch.device("cpu"))
    assert off.figures is None and "planned for world 2 (2 per node); this start runs world 1" in off.error
    bare = Prediction(plan, rank=0, device=torch.device("cpu"))  # a plan no submission handed over
    assert bare.figures is None and bare.error.startswith("no planned memory in this start's plan")
    assert off.record(None) == {"rank": 0, "error": off.error}  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [
    ["+scheme=fsdp", "model.vocab_size=250"],  # shards of uneven size over 8 ranks
    ["+scheme=hsdp", "scheme.dp_replicate=2"],
    ["+scheme=zero_tp_pp", "scheme.tp=2", "scheme.pp=2", "train.global_batch=16"],
    ["+scheme=hybrid", "scheme.tp=2", "scheme.pp=2", "train.global_batch=16"],
])
def test_the_figures_made_per_class_of_ranks_are_every_ranks_own(layout):
    """plan.json's figures are made once per class of ranks (dtk.plan.layout.RankClasses);
    each rank's are still what the budget gives that rank alone."""
    cfg = compose([*SMALL, "tasks_per_node=8", *layout])
    plan = make_plan(cfg, cwd="/tmp")
    memory = planned_memory(cfg, plan, check(cfg, plan))
    table, of_rank = memory["devices"]["cpu"]["figures"], memory["devices"]["cpu"]["of_rank"]
    shape = real_shape(plan.config)
    assert len(of_rank) == plan.world_size == 8
    for rank in range(plan.world_size):
        assert table[of_rank[rank]] == figures(rank_prediction(plan.config, plan, shape, rank=rank, device="cpu"))
