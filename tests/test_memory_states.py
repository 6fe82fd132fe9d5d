"""The planned bytes of parameters, gradients and optimizer state of every rank equal the
bytes of the real tensors, for the built-in transformer under every scheme on 4 CPU
processes (gloo): each case's model is built and stepped exactly as a worker does it
(tests/memory_support.py), and the plan (dtk.plan.cost.memory, no torch) predicts each rank.

Uneven sizes (vocab 250, 60 positions over 4 shards) check torch.chunk's rounding; ZeRO-1
checks the whole-tensor partition; pipelines check the stage split.
"""

from __future__ import annotations

import pytest

from dtk.config.compose import compose
from dtk.plan.cost.inputs import context
from dtk.plan.cost.memory import rank_bytes
from dtk.plan.cost.report import chosen_variant
from dtk.plan.plan import make_plan
from memory_support import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.dist]

WORLD = 4
MODEL = ["model.num_layers=4", "model.dim=48", "tasks_per_node=4", "train.global_batch=8"]
UNEVEN = ["model.vocab_size=250", "model.seq_len=60"]
TP_SIZES = ["model.vocab_size=256", "model.seq_len=64"]  # tensor parallelism splits them evenly

CASES = {
    "ddp": ["+scheme=ddp", *UNEVEN],
    "zero": ["+scheme=zero", *UNEVEN],
    "zero2": ["+scheme=zero2", *UNEVEN],
    "fsdp": ["+scheme=fsdp", *UNEVEN],
    "hsdp": ["+scheme=hsdp", "scheme.dp_replicate=2", *UNEVEN],
    "tp": ["+scheme=tp", *TP_SIZES],
    "pp": ["+scheme=pp", *UNEVEN],
    "pp_interleaved": ["+scheme=pp", "scheme.pp=2", "scheme.dp_shard=2", "scheme.pp_schedule=interleaved_1f1b",
                       "scheme.pp_virtual_stages=2", *UNEVEN],
    "hybrid": ["+scheme=hybrid", "scheme.dp_shard=2", "scheme.tp=2", *TP_SIZES],
    "zero_tp": ["+scheme=zero_tp_pp", "scheme.pp=1", *TP_SIZES],  # ZeRO-1 owners on the tp-local sizes
}


def predicted(overrides: list[str]):
    cfg = compose([*MODEL, *overrides])
    plan = make_plan(cfg, cwd="/tmp")
    ctx = context(cfg, plan)
    job = ctx.job(chosen_variant(ctx, plan))
    return plan, [rank_bytes(ctx.shape, job, r) for r in range(WORLD)]


def test_planned_state_bytes_equal_the_real_tensors_on_every_rank():
    plans, predictions = {}, {}
    for name, overrides in CASES.items():
        plans[name], predictions[name] = predicted(overrides)
    measured = run_ranks(plans, WORLD)
    mismatches = []
    for name in CASES:
        for rank in range(WORLD):
            want, got = predictions[name][rank], measured[name][rank]
            for kind in ("params", "grads", "optimizer"):
                if getattr(want, kind) != got[kind]:
                    mismatches.append(f"{name} rank {rank} {kind}: planned {getattr(want, kind)}, real {got[kind]}")
    assert not mismatches, "\n".join(mismatches)
    # the cases really differ: sharding shrinks what a rank holds
    assert measured["fsdp"][0]["params"] < measured["ddp"][0]["params"] / 3
    assert measured["zero"][0]["optimizer"] < measured["ddp"][0]["optimizer"] / 2
