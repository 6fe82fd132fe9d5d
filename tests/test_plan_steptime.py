"""The step-time model (dtk.plan.cost.steptime): dtk's own FLOP count, recompute, the exposed
share of each axis's traffic, the pipeline bubble, and where the link figures come from."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dtk.common.errors import UserError
from dtk.config.compose import compose
from dtk.config.convert import builtin_transformer
from dtk.config.schema import ClusterConfig, SchemeConfig
from dtk.plan.accelerators import ACCELERATORS, WIDTH_SHARES, gemm_width
from dtk.plan.cost.comm import traffic
from dtk.plan.cost.memory import Job, precision_for, scheme_config
from dtk.plan.cost.steptime import Speeds, doctor_links, flops_per_token, hardware_of, step_time
from dtk.plan.degrees import Degrees
from dtk.plan.shape import builtin_shape, whatif_shape

BASE = dataclasses.asdict(SchemeConfig())
H100 = ClusterConfig(accelerator="h100-80gb")
SHAPE = whatif_shape({"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 4096, "vocab_size": 32000})


def job(degrees: Degrees, *, num_micro: int = 1, **scheme) -> Job:
    s = scheme_config(dict(BASE, **scheme))
    return Job(s, degrees, micro_batch=1, num_micro=num_micro, device="cuda", precision=precision_for(s, "cuda"))


def test_flops_are_dtks_own_count_and_full_checkpointing_adds_a_forward():
    from dtk.train.flops import transformer_flops_per_token

    model = builtin_transformer(compose(["model.dim=256", "model.num_layers=6", "model.num_heads=8"]).model)
    shape = builtin_shape(model)
    want = transformer_flops_per_token(vocab_size=model.vocab_size, dim=model.dim, num_layers=model.num_layers,
                                       ffn_hidden=model.ffn_hidden, seq_len=model.seq_len)
    assert flops_per_token(shape, "none") == (pytest.approx(want), pytest.approx(want))
    assert flops_per_token(shape, "selective")[1] == pytest.approx(want)  # elementwise work only
    m, hw = flops_per_token(shape, "full")
    block = sum(t.numel for t in shape.tensors if t.matmul and t.block)
    attention = 12 * model.num_layers * model.dim * model.seq_len
    assert hw - m == pytest.approx(2 * block + attention / 3)
    assert flops_per_token(whatif_shape({"params": 1e9}), "none") is None  # no tokens to count


def test_compute_scales_with_devices_and_the_bubble_with_stages_over_micro_batches():
    hw = hardware_of(H100, device="cuda", param_dtype="auto")
    one = step_time(SHAPE, job(Degrees(1, 1, 8, 1), data_parallel="fsdp"), global_batch=64, tasks_per_node=8, hw=hw)
    share = hw.speeds.efficiency_at(None, gemm_width(SHAPE.hidden, SHAPE.ffn_hidden, 1))
    assert one.compute_s == pytest.approx(64 * 4096 * flops_per_token(SHAPE, "none")[1] / 8 / (989.5e12 * share))
    pp = step_time(SHAPE, job(Degrees(1, 4, 2, 1), num_micro=16, data_parallel="fsdp"), global_batch=64,
                   tasks_per_node=8, hw=hw)
    assert pp.compute_s == pytest.approx(one.compute_s)
    assert pp.bubble_s == pytest.approx(pp.compute_s * 3 / 16)
    inter = step_time(SHAPE, job(Degrees(1, 4, 2, 1), num_micro=16, data_parallel="fsdp", pp_virtual_stages=2,
                                 pp_schedule="interleaved_1f1b"), global_batch=64, tasks_per_node=8, hw=hw)
    assert inter.bubble_s == pytest.approx(inter.compute_s * 3 / 32)
    assert one.mfu == pytest.approx(one.model_flops / one.total_s / (8 * 989.5e12))


def test_tensor_parallel_traffic_is_exposed_and_fsdp_hides_behind_compute():
    hw = hardware_of(H100, device="cuda", param_dtype="auto")
    tp = step_time(SHAPE, job(Degrees(1, 1, 1, 8), data_parallel="fsdp"), global_batch=8, tasks_per_node=8, hw=hw)
    assert tp.axes["tp"] > 0 and tp.comm_s == pytest.approx(tp.axes["tp"])
    fsdp = step_time(SHAPE, job(Degrees(1, 1, 8, 1), data_parallel="fsdp"), global_batch=64, tasks_per_node=8, hw=hw)
    assert fsdp.axes["dp_shard"] == 0  # 8 ranks on NVLink: all hidden
    # the same shards across 64 nodes of one GPU each: the network, and more than compute hides
    wide = step_time(SHAPE, job(Degrees(1, 1, 64, 1), num_micro=8, data_parallel="fsdp"), global_batch=512,
                     tasks_per_node=1, hw=hw)
    assert wide.axes["dp_shard"] > 0


def test_links_from_the_doctor_then_the_cluster_then_the_table(tmp_path):
    def rows(busbw):
        return [{"size_mb": 1.0, "busbw_gbs": busbw / 10}, {"size_mb": 1024.0, "busbw_gbs": busbw}]

    # the layout python -m dtk.doctor writes (dtk/doctor/worker.py)
    groups = [{"group": "world", "ranks": 16, "rows": rows(30.0)},
              {"group": "across nodes (first rank of each)", "ranks": 2, "rows": rows(41.0)},
              {"group": "inside node1", "ranks": 8, "rows": rows(350.0)},
              {"group": "inside node2", "ranks": 8, "rows": rows(330.0)}]
    (tmp_path / "doctor.json").write_text(json.dumps({"groups": groups}))
    assert doctor_links(str(tmp_path)) == (340.0, 41.0)
    hw = hardware_of(H100, device="cuda", param_dtype="auto", doctor=str(tmp_path))
    assert (hw.speeds.intra_gbps, hw.speeds.nic_gbps) == (340.0, 41.0) and "dtk.doctor" in hw.source
    site = dataclasses.replace(H100, intra_node_gbps=100.0, inter_node_gbps=10.0)
    hw = hardware_of(site, device="cuda", param_dtype="auto")
    assert (hw.speeds.intra_gbps, hw.speeds.nic_gbps) == (100.0, 10.0)
    hw = hardware_of(H100, device="cuda", param_dtype="auto")
    row = ACCELERATORS["h100-80gb"]
    assert hw.speeds == Speeds(row.efficiency, row.nvlink_gbps, row.nic_gbps, 1, row.host_gbps, (), WIDTH_SHARES)
    assert hardware_of(H100, device="cpu", param_dtype="auto") is None
    assert hardware_of(ClusterConfig(), device="cuda", param_dtype="auto") is None  # peak unknown
    with pytest.raises(UserError, match="plan.doctor="):
        doctor_links(str(tmp_path / "missing"))


SHORT = whatif_shape({"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 64, "vocab_size": 32000})
"""Short sequences: little compute to hide the gradients behind."""


def _exposed(degrees: Degrees, cluster: ClusterConfig, **scheme) -> tuple[float, float, int]:
    """(seconds, bytes) of the data-parallel axis of a 16-GPU job on 2 nodes of 8, and its ranks per node."""
    hw = hardware_of(cluster, device="cuda", param_dtype="auto")
    j = job(degrees, **scheme)
    t = step_time(SHORT, j, global_batch=degrees.dp, tasks_per_node=8, hw=hw)
    axis = next(a for a in traffic(SHORT, j, 8) if a.axis == "dp_replicate")
    assert t.axes["dp_replicate"] > 0  # more than the last backward hides
    return t.axes["dp_replicate"] + t.compute_s * 2 / 3, axis.bytes_per_step, axis.ranks_per_node


def test_a_group_spanning_whole_nodes_uses_every_card_and_one_rank_per_node_uses_one():
    row = ACCELERATORS["a100-80gb"]
    a100 = ClusterConfig(accelerator="a100-80gb")
    rails = dataclasses.replace(a100, nics_per_node=8)
    # DDP over all 16 ranks: 8 of each group on a node, the node's 8 cards (capped by NVLink)
    whole_1, nbytes, k = _exposed(Degrees(16, 1, 1, 1), a100, data_parallel="ddp")
    whole_8, _, _ = _exposed(Degrees(16, 1, 1, 1), rails, data_parallel="ddp")
    assert k == 8
    assert whole_1 == pytest.approx(nbytes / (row.nic_gbps * 1e9))
    assert whole_8 == pytest.approx(nbytes / (min(8 * row.nic_gbps, row.nvlink_gbps) * 1e9))
    # tp=8 inside the node, DDP across: one rank per node in each group, one card each with
    # 8 cards; the node's 8 groups share a single card
    rail_1, nbytes, k = _exposed(Degrees(2, 1, 1, 8), a100, data_parallel="ddp")
    rail_8, _, _ = _exposed(Degrees(2, 1, 1, 8), rails, data_parallel="ddp")
    assert k == 1
    assert rail_8 == pytest.approx(nbytes / (row.nic_gbps * 1e9))
    assert rail_1 == pytest.approx(nbytes / (row.nic_gbps / 8 * 1e9))


def test_the_measured_card_and_the_cards_per_node_feed_the_rails(tmp_path):
    rows = [{"size_mb": 1024.0, "busbw_gbs": 20.0}]
    (tmp_path / "doctor.json").write_text(json.dumps({"groups": [
        {"group": "across nodes (first rank of each)", "ranks": 2, "rows": rows}]}))
    cluster = ClusterConfig(accelerator="h100-80gb", nics_per_node=4)
    hw = hardware_of(cluster, device="cuda", param_dtype="auto", doctor=str(tmp_path))
    assert (hw.speeds.nic_gbps, hw.speeds.nics_per_node) == (20.0, 4) and "4 network card(s)" in hw.source
    assert hw.speeds.across_nodes(8, 8) == 80.0  # whole nodes: the 4 cards
    assert hw.speeds.across_nodes(2, 8) == 20.0  # 4 groups of 2 on a node: a card each
    assert hw.speeds.across_nodes(1, 8) == 10.0  # 8 groups of 1 share 4 cards


def test_cards_per_node_must_be_positive():
    from dtk.plan.plan import make_plan

    with pytest.raises(UserError, match="cluster.nics_per_node=0"):
        make_plan(compose(["cluster.nics_per_node=0"]), cwd="/tmp")


def test_an_accelerators_name_is_written_in_the_accelerator_table_only():
    """dtk/plan/accelerators.py is the one table: no other module of dtk spells a row's name
    (`h100-80gb`, anywhere in its text), nor holds a device name torch gives a part as a
    string of its own (`"H100 PCIe"`: a second table of names)."""
    import ast
    import re

    from conftest import REPO

    keys = sorted(ACCELERATORS, key=len, reverse=True)
    row_name = re.compile("|".join(rf"(?<![\w-]){re.escape(k)}(?![\w-])" for k in keys), re.IGNORECASE)
    device_names = {n.upper() for row in ACCELERATORS.values() for n in (row.name, *row.device_names)}
    found = {}
    for path in sorted((REPO / "dtk").rglob("*.py")):
        where = path.relative_to(REPO).as_posix()
        if where == "dtk/plan/accelerators.py":
            continue
        text = path.read_text()
        literals = {node.value for node in ast.walk(ast.parse(text))
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        hits = set(row_name.findall(text)) | {v for v in literals if v.strip().upper() in device_names}
        if hits:
            found[where] = sorted(hits)
    assert found == {}
    assert {"a100-40gb", "a100-80gb", "a800", "h100-80gb", "h100-pcie", "h100-nvl", "h800", "h200", "gh200",
            "b200", "mi250x", "mi300x"} <= set(ACCELERATORS)


def test_narrow_gemms_run_below_the_tables_figure_wide_ones_at_it():
    """The default curve (dtk.plan.accelerators.WIDTH_SHARES, Megatron-LM's achieved rates by
    GEMM width): a small model or a thin tp slice computes at a lower share of the peak."""
    hw = hardware_of(H100, device="cuda", param_dtype="auto")
    row, sp = ACCELERATORS["h100-80gb"], hw.speeds
    assert gemm_width(4096, 16384, 1) == pytest.approx(2 / (1 / 4096 + 1 / 16384))
    assert gemm_width(12288, 49152, 8) < gemm_width(12288, 49152, 1)  # a thinner slice, a narrower GEMM
    assert sp.efficiency_at(None, 2000) == pytest.approx(row.efficiency * WIDTH_SHARES[0][1])  # held below
    assert sp.efficiency_at(None, 20000) == pytest.approx(row.efficiency)  # the widest
    assert sp.efficiency_at(None, 4096) < sp.efficiency_at(None, 8192) < sp.efficiency_at(None, 13653)
    small = whatif_shape({"layers": 24, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab_size": 32000})
    large = whatif_shape({"layers": 24, "hidden": 16384, "heads": 128, "seq_len": 2048, "vocab_size": 32000})

    def rate(shape, tp):  # model FLOPs per second per device
        t = step_time(shape, job(Degrees(1, 1, 8 // tp, tp), data_parallel="fsdp"), global_batch=8,
                      tasks_per_node=8, hw=hw)
        return t.tokens * flops_per_token(shape, "none")[1] / t.compute_s / 8

    assert rate(small, 1) < rate(large, 1)
    assert rate(large, 8) < rate(large, 1)
