"""The plan held against a run (dtk.plan.cost.predict, dtk.worker.memory): each rank's
prediction against its measurement, the `plan_mismatch` limit, and the one line an
out-of-memory error stops the job with. Pure logic and one-process pieces; the real runs
are in tests/test_spine.py (a 2-process run's summary.json) and tests/test_plan_oom.py."""

from __future__ import annotations

import dataclasses

import torch

from dtk.config.compose import compose
from dtk.parallel.count import real_shape
from dtk.plan.cost.memory import RankBytes
from dtk.plan.cost.predict import (
    MISMATCH,
    comparable,
    mismatch_event,
    oom_line,
    rank_prediction,
    rank_record,
    summarize,
)
from dtk.plan.plan import make_plan
from dtk.worker.memory import is_out_of_memory, measure_index

SMALL = ["model.dim=64", "model.num_layers=2", "model.num_heads=4", "model.seq_len=32", "model.vocab_size=256",
         "train.global_batch=8", "tasks_per_node=2"]
# 34M parameters: 1.50 GB per device under ddp on 2 CPU workers, 1.07 GB under fsdp
MEDIUM = ["model.dim=512", "model.num_layers=8", "model.num_heads=8", "model.vocab_size=8000"]


def _bytes(rank: int, **kinds: int) -> RankBytes:
    base = dict(params=100, grads=100, optimizer=200, activations=300, buffers=50, margin=1000, host=0)
    return RankBytes(rank=rank, **{**base, **kinds}, activations_saved=250, detail={"fsdp_gather": 40})


def test_what_each_device_measures_is_compared():
    b = _bytes(0)
    assert comparable(b, "cuda") == 100 + 100 + 200 + 300 + 50  # no margin
    assert comparable(b, "cpu") == 100 + 100 + 200 + 250  # kept for backward
    kept = dataclasses.replace(b, gathered_kept=40)  # reshard_after_forward=false, or a pipeline
    assert comparable(kept, "cpu") == 100 + 100 + 200 + 250 + 40  # gathered all step


def test_a_gap_above_the_limit_on_any_rank_is_a_mismatch_event():
    def record(rank: int, measured: int) -> dict:
        return rank_record(_bytes(rank), {"total": measured}, rank=rank, device="cpu",
                           activations_estimated=True)

    planned = 650
    within = summarize([record(0, planned), record(1, round(planned * (1 + MISMATCH) - 1))], device="cpu")
    assert within["predicted_bytes"] == planned and within["mismatch_ranks"] == []
    assert mismatch_event(within) is None
    off = summarize([record(0, planned), record(1, round(planned * 1.5))], device="cpu")
    assert off["mismatch_ranks"] == [1] and off["measured_bytes"] == 975 and off["gap"] == 0.5
    event = mismatch_event(off)
    assert event["rank"] == 1 and event["gap"] == 0.5 and event["ranks"] == [1]
    assert "rank 1 measured" in event["detail"] and "+50%" in event["detail"]
    under = summarize([record(0, planned // 2)], device="cpu")  # far below the plan is a mismatch too
    assert mismatch_event(under)["gap"] == -0.5


def test_the_second_step_of_a_start_is_measured_when_there_is_one():
    assert measure_index(0, 10) == 1 and measure_index(9, 10) == 9 and measure_index(4, 6) == 5


def test_out_of_memory_is_recognised_through_wrapping_errors():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("stage 1 failed") from inner
    except RuntimeError as wrapped:
        assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("boom"))


def _planned(*overrides: str):
    cfg = compose([*SMALL, *overrides])
    plan = make_plan(cfg, cwd="/tmp")
    return cfg, plan, real_shape(cfg)


def test_worker_prediction_is_the_budget_of_the_real_model():
    # plan.params is a what-if for planning without a model; the workers predict their real model
    cfg, plan, shape = _planned("+scheme=fsdp", "plan.params=7.5e9")
    assert shape.params < 1e6
    b = rank_prediction(cfg, plan, shape, rank=1, device="cpu")
    assert 0 < b.params < shape.params * 4 and b.activations_saved > 0


def test_oom_line_names_the_planned_numbers_and_what_would_fit():
    cfg, plan, shape = _planned(*MEDIUM, "+scheme=ddp", "cluster.device_memory_gb=1.1")
    line = oom_line(cfg, plan, shape, rank=1, host="node7", device="cpu", capacity=None)
    assert "\n" not in line and line.startswith("out of memory on rank 1 (node7): planned 1.50 GB per device under ddp")
    assert " on 1 node(s) x 2 = params 0.13 + grads 0.13 + optimizer 0.27 + " in line
    assert "against 1.10 GB (cluster.device_memory_gb=1.1)" in line
    assert line.endswith("would fit: +scheme=fsdp nodes=1; see python -m dtk.plan")


def test_oom_line_when_the_plan_said_it_fits_plans_for_less():
    cfg, plan, shape = _planned("+scheme=ddp", "cluster.device_memory_gb=80")
    line = oom_line(cfg, plan, shape, rank=0, host="h", device="cuda", capacity=None)
    assert "it needs more than planned: planned again for " in line
    assert "would fit: " in line or "no override found: " in line


def test_without_a_named_memory_the_gpu_is_the_one_the_worker_sees():
    cfg, plan, shape = _planned("+scheme=ddp")
    line = oom_line(cfg, plan, shape, rank=0, host="h", device="cuda", capacity=3_000_000_000)
    assert "against 3.00 GB (this cuda device (3.0 GB))" in line
