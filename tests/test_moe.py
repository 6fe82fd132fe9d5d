"""The mixture of experts (model=moe) in one process, and expert parallelism at plan time:
routing (ties, capacity), the load-balancing loss, and every layout the runtime cannot run
stopped before launch with one `error:` line and exit 2 (`dtk.submit` and `dtk.plan`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_main
from dtk.config.compose import compose
from dtk.plan.plan import make_plan


def _moe(**keys):
    from dtk.models.moe import MoE

    layer = MoE(8, 16, **{"num_experts": 4, "top_k": 2, "aux_loss_weight": 0.0, "capacity_factor": 0.0, **keys})
    torch.manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return layer


def test_equal_router_scores_go_to_the_lower_experts():
    layer = _moe()
    torch.nn.init.zeros_(layer.router.weight)  # every expert scores alike: experts 0 and 1, weight 1/2 each
    x = torch.randn(1, 5, 8)
    e = layer.experts
    want = sum(0.5 * (torch.nn.functional.silu(x @ e.w1[i].T) * (x @ e.w3[i].T)) @ e.w2[i].T for i in (0, 1))
    torch.testing.assert_close(layer(x), want)


def test_a_capacity_factor_drops_what_an_expert_cannot_take():
    layer = _moe(top_k=1, capacity_factor=1.0)
    torch.nn.init.zeros_(layer.router.weight)  # all 8 tokens choose expert 0; it takes 8 x 1 / 4 = 2
    x = torch.randn(1, 8, 8)
    out = layer(x)
    e = layer.experts
    first = (torch.nn.functional.silu(x[0, :2] @ e.w1[0].T) * (x[0, :2] @ e.w3[0].T)) @ e.w2[0].T
    torch.testing.assert_close(out[0, :2], first)
    assert torch.count_nonzero(out[0, 2:]) == 0  # dropped: the residual carries them
    assert torch.count_nonzero(_moe(top_k=1)(x)[0, 2:]) > 0  # dropless by default


def test_the_balance_loss_is_num_experts_times_share_times_probability():
    layer = _moe(aux_loss_weight=0.5)
    x = torch.randn(2, 6, 8)
    layer(x)
    probs = torch.softmax(layer.router(x.reshape(-1, 8)), -1)
    chosen = probs.topk(2, -1).indices
    share = torch.bincount(chosen.flatten(), minlength=4).float() / chosen.numel()
    assert layer.aux_loss is not None
    torch.testing.assert_close(layer.aux_loss, 0.5 * 4 * (share * probs.mean(0)).sum())
    balanced = torch.full((4,), 0.25)
    assert float(4 * (balanced * balanced).sum()) == 1.0  # its minimum, at an even load


def test_moe_transformer_builds_with_stacked_experts_and_the_dense_one_is_unchanged():
    cfg = compose(["model=moe"])
    assert (cfg.model.kwargs["num_experts"], cfg.model.kwargs["top_k"]) == (4, 2)
    from dtk.models.transformer import build

    moe = build(**{**cfg.model.kwargs, "num_layers": 1})
    assert moe.layers["0"].mlp.experts.w1.shape == (4, 176, 64)
    dense = build(**{**compose([]).model.kwargs, "num_layers": 1})
    assert {n for n, _ in dense.named_parameters()} >= {"layers.0.mlp.w1.weight", "layers.0.mlp.w2.weight"}


def test_ep_plans_as_a_carved_axis():
    p = make_plan(compose(["model=moe", "+scheme=ep", "tasks_per_node=4", "scheme.ep=2", "train.global_batch=8"]),
                  cwd="/tmp")
    assert (p.degrees.ep, p.degrees.dp_shard, p.degrees.world) == (2, 4, 4)
    assert "ep=2" in p.degrees.describe()


CASES = {
    "ep_does_not_divide": (["model=moe", "+scheme=ep", "tasks_per_node=2", "scheme.ep=4"],
                           "scheme.ep=4 does not divide dp_shard=2 x cp=1 = 2"),
    "ep_dense": (["+scheme=ep", "tasks_per_node=2", "scheme.ep=2"],
                 "scheme.ep=2 with model._target_=dtk.models.transformer.build without experts"),
    "ep_hf": (["model=hf", "model.config={tmp}/tiny-mixtral", "model.seq_len=32", "+scheme=ep", "tasks_per_node=2",
               "scheme.ep=2"], "scheme.ep=2 with model=hf: expert parallelism splits the experts of the built-in"),
    "ep_experts": (["model=moe", "model.num_experts=3", "model.top_k=1", "+scheme=ep", "tasks_per_node=2",
                    "scheme.ep=2"], "scheme.ep=2 does not divide model.num_experts=3"),
    "top_k": (["model=moe", "model.top_k=5", "tasks_per_node=2"],
              "model.top_k=5 with model.num_experts=4: each token goes to top_k different experts"),
    "ep_offload": (["model=moe", "+scheme=ep", "tasks_per_node=2", "scheme.cpu_offload=true"],
                   "scheme.ep=2 with scheme.data_parallel=fsdp and scheme.cpu_offload=true"),
    "tp": (["model=moe", "+scheme=tp", "tasks_per_node=2"], "scheme.tp=2 with model.num_experts=4"),
}


@pytest.mark.parametrize("command", ["dtk.submit", "dtk.plan"])
@pytest.mark.parametrize("case", list(CASES))
def test_what_ep_cannot_run_is_one_error_line_with_exit_2(case, command, tmp_path: Path):
    overrides, message = CASES[case]
    (tmp_path / "tiny-mixtral").mkdir()
    (tmp_path / "tiny-mixtral" / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "num_local_experts": 4, "num_experts_per_tok": 2}))
    proc = run_main(command, *(o.format(tmp=tmp_path) for o in overrides), f"run.root={tmp_path}/runs",
                    cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert message in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()


def test_the_planner_sees_the_moe_model_the_workers_build():
    from dtk.config.schema import TransformerConfig
    from dtk.plan.shape import builtin_shape

    keys = dict(vocab_size=32, dim=24, num_layers=2, num_heads=2, seq_len=16, num_experts=4, top_k=2)
    from dtk.models.transformer import build

    with torch.device("meta"):
        model = build(**keys)
    shape = builtin_shape(TransformerConfig(**keys))
    assert [(t.name, t.shape) for t in shape.tensors] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert [m[0] for m in shape.modules] == [n for n, _ in model.named_modules()]
    assert [m[1] for m in shape.modules] == [type(m).__name__ for _, m in model.named_modules()]
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.params == sum(p.numel() for p in model.parameters())  # memory: every expert
    assert shape.active_params == shape.params - experts + experts * 2 / 4  # FLOPs: top_k of them


def test_flops_count_active_experts_alike_in_the_planner_and_the_mfu():
    from dtk.config.schema import TransformerConfig
    from dtk.plan.cost.steptime import flops_per_token as planned
    from dtk.plan.shape import builtin_shape
    from dtk.train.flops import flops_per_token

    cfg = compose(["model=moe", "model.num_experts=8", "model.top_k=2"])
    dim, layers, hidden, vocab, seq = 64, 2, 176, 256, 64
    by_hand = 6 * (layers * (4 * dim * dim + 2 * 3 * dim * hidden + dim * 8) + vocab * dim) + 12 * layers * dim * seq
    assert flops_per_token(cfg.model) == by_hand
    shape = builtin_shape(TransformerConfig(**cfg.model.kwargs, tp_plan={}))
    assert planned(shape, "none") == (by_hand, by_hand)
    dense = flops_per_token(compose([]).model)
    assert by_hand == dense + 6 * layers * (3 * dim * hidden + dim * 8)  # one more active expert, the router


def test_ep_groups_are_consecutive_ranks_of_dp_shard_x_cp():
    from dtk.plan.degrees import Degrees
    from dtk.plan.layout import axis_groups

    d = Degrees(dp_replicate=1, pp=1, dp_shard=2, cp=2, tp=2, ep=2)  # rank = (dp_shard*2 + cp)*2 + tp
    assert axis_groups(d, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    d4 = Degrees(dp_replicate=2, pp=1, dp_shard=4, tp=1, ep=4)
    assert axis_groups(d4, "ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_plan_prints_the_active_parameters_of_a_mixture_of_experts(tmp_path):
    moe = run_main("dtk.plan", "model=moe", cwd=tmp_path)
    assert moe.returncode == 0, moe.stderr
    assert "340,800 parameters (model (built-in transformer)), 205,632 active per token" in moe.stdout
    dense = run_main("dtk.plan", cwd=tmp_path)
    assert "active per token" not in dense.stdout
