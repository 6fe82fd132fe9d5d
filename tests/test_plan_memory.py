"""The memory budget's arithmetic, without torch: the ZeRO paper's model states, torch.chunk
rounding, the ZeRO-1 partition, placement and traffic per axis, the recommendation on CPU workers."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import dtk
from dtk.config.compose import compose
from dtk.config.convert import builtin_transformer
from dtk.config.schema import SchemeConfig
from dtk.plan.cost.activations import in_flight
from dtk.plan.cost.budget import all_rows
from dtk.plan.cost.comm import axis_groups, crosses_nodes, placement
from dtk.plan.cost.inputs import context
from dtk.plan.cost.memory import Job, device_bytes, precision_for, scheme_config
from dtk.plan.cost.search import Search, searched
from dtk.plan.degrees import Degrees
from dtk.plan.layout import chunk, zero1_owner
from dtk.plan.plan import make_plan
from dtk.plan.shape import builtin_shape, whatif_shape

BASE = dataclasses.asdict(SchemeConfig())

# Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 devices, 2 + 2 + 12 bytes per parameter.
ZERO_PAPER_GB = {"ddp": 120.0, "zero": 31.4, "zero2": 16.6, "fsdp": 1.9}
ZERO_SCHEMES = {
    "ddp": (dict(BASE), Degrees(dp_replicate=64, dp_shard=1, tp=1, pp=1)),
    "zero": (dict(BASE, shard_optimizer=True), Degrees(dp_replicate=64, dp_shard=1, tp=1, pp=1)),
    "zero2": (dict(BASE, data_parallel="fsdp", reshard_after_forward=False),
              Degrees(dp_replicate=1, dp_shard=64, tp=1, pp=1)),
    "fsdp": (dict(BASE, data_parallel="fsdp"), Degrees(dp_replicate=1, dp_shard=64, tp=1, pp=1)),
}


@pytest.mark.parametrize("key", ZERO_PAPER_GB)
def test_model_states_match_the_zero_paper_within_2_percent(key):
    shape = whatif_shape({"params": 7.5e9})
    raw, degrees = ZERO_SCHEMES[key]
    scheme = scheme_config(raw)
    plan_bytes = {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}
    job = Job(scheme, degrees, micro_batch=1, num_micro=1, device="cuda",
              precision=precision_for(scheme, "cuda", plan_bytes))
    got = device_bytes(shape, job).model_states / 1e9
    assert abs(got - ZERO_PAPER_GB[key]) <= 0.02 * ZERO_PAPER_GB[key], (key, got)


def test_chunk_follows_torch_chunk():
    # torch.chunk(torch.arange(10), 4) -> sizes 3, 3, 3, 1; chunk(5, 4) -> 2, 2, 1 (and an empty fourth)
    assert [chunk(10, 4, i) for i in range(4)] == [3, 3, 3, 1]
    assert [chunk(5, 4, i) for i in range(4)] == [2, 2, 1, 0]
    assert [chunk(8, 4, i) for i in range(4)] == [2, 2, 2, 2]


def test_zero1_partition_largest_first_to_least_loaded():
    # dtk.parallel.zero.partition: sizes 5, 4, 3, 3, 1 over 2 ranks -> 5:r0, 4:r1, 3:r1, 3:r0, 1:r1
    assert zero1_owner((5, 4, 3, 3, 1), 2) == (0, 1, 1, 0, 1)


def test_builtin_shape_counts_the_transformer():
    model = builtin_transformer(compose([]).model)
    shape = builtin_shape(model)
    dim, layers, vocab, seq = model.dim, model.num_layers, model.vocab_size, model.seq_len
    hidden = 16 * -(-8 * dim // 3 // 16)  # 8/3 dim rounded up to 16
    block = 4 * dim * dim + 3 * dim * hidden + 2 * dim
    assert shape.params == layers * block + 2 * vocab * dim + seq * dim + dim
    tp = {t.name: t.tp_dim for t in shape.tensors}
    assert tp["layers.0.attn.wq.weight"] == 0 and tp["layers.0.attn.wo.weight"] == 1
    assert tp["tok_embeddings.weight"] == 0 and tp["layers.0.attn_norm.weight"] is None


def test_placement_and_which_groups_cross_nodes():
    # 2 nodes x 4 workers, dp_replicate=2 x dp_shard=2 x tp=2 (the mesh docstring's example)
    d = Degrees(dp_replicate=2, dp_shard=2, tp=2, pp=1)
    assert axis_groups(d, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(d, "dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(d, "dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [crosses_nodes(d, a, 4) for a in ("tp", "dp_shard", "dp_replicate")] == [False, False, True]
    assert [r["node"] for r in placement(d, 4)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_pipeline_micro_batches_in_flight():
    assert in_flight("gpipe", pp=4, pp_index=0, num_micro=8, virtual=1) == 8
    assert [in_flight("1f1b", pp=4, pp_index=r, num_micro=8, virtual=1) for r in range(4)] == [4, 3, 2, 1]
    # interleaved, 2 chunks per rank: torch's warm-up (v-1) * per_round + 2 (pp-1-rank), plus one
    assert in_flight("interleaved_1f1b", pp=2, pp_index=0, num_micro=4, virtual=2) == 5


def budget(*overrides: str):
    cfg = compose(["cluster=lab", *overrides])
    plan = make_plan(cfg, cwd="/tmp")
    ctx = context(cfg, plan)
    return ctx, all_rows(ctx)


@pytest.mark.slow
def test_recommendation_without_a_time_model_is_the_simplest_that_fits():
    # On CPU workers (no step-time model) the search ranks fits -> nodes -> simplest.
    ctx, rows = budget("cluster.mem_gb=16", "nodes=2", "tasks_per_node=2")
    ranked, _ = searched(ctx, None, max_nodes=None)
    assert ranked[0].overrides == ["+scheme=ddp", "nodes=2"]  # a tiny model fits anywhere: data parallel
    # 1.5B parameters x 16 bytes = 25 GB per replica on 8.6 GB devices: states must be sharded.
    big = ["model.dim=2048", "model.num_layers=28", "model.num_heads=16", "model.vocab_size=32000",
           "model.seq_len=256", "train.global_batch=64", "train.micro_batch=1", "cluster.mem_gb=16",
           "tasks_per_node=2"]
    ctx, rows = budget(*big, "nodes=4")
    ranked, why = searched(ctx, None, max_nodes=None)
    assert rows["ddp"].estimate.fits is False and why.startswith("fits on the 4 node(s) asked")
    assert ranked[0].key != "ddp" and all(c.fits for c in ranked)
    assert [c.complexity for c in ranked] == sorted(c.complexity for c in ranked)
    # On one node nothing fits, whatever the knobs: the fewest nodes at which something does.
    ctx, rows = budget(*big, "nodes=1")
    ranked, why = searched(ctx, None, max_nodes=None)
    nodes = ranked[0].variant.nodes
    assert nodes > 1 and f"nodes={nodes}" in ranked[0].overrides and f"{nodes} is the fewest that fit" in why
    assert all(Search(ctx, None).at(n) == [] for n in range(1, nodes))  # fewer nodes: nothing fits


def test_plan_command_prints_the_budget_as_json_without_torch(tmp_path):
    proc = dtk("-X", "importtime", "-m", "dtk.plan", "+scheme=fsdp", "tasks_per_node=2", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "dtk.plan.cost.memory" in imported  # importtime output is really there
    assert not any(name == "torch" or name.startswith("torch.") for name in imported)
    out = json.loads(proc.stdout)
    for key in ("params", "min_devices", "min_nodes", "fits", "per_device_bytes", "recommended", "schemes"):
        assert key in out, key
    assert set(out["per_device_bytes"]) >= {"params", "grads", "optimizer", "activations", "buffers", "total"}
    assert set(out["recommended"]) >= {"scheme", "reason", "overrides"}
    assert set(out["schemes"]) == {"ddp", "zero", "zero2", "fsdp", "hsdp", "tp", "pp", "hybrid"}
    b = out["per_device_bytes"]
    assert b["total"] == sum(b[k] for k in ("params", "grads", "optimizer", "activations", "buffers", "margin"))
    assert out["scheme"] == "fsdp" and out["fits"] is True and out["min_nodes"] == 1
    assert out["per_device_bytes"] == out["schemes"]["fsdp"]["per_device_bytes"]  # the same job, the same numbers
