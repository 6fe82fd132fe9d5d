"""The planner's search with the split axes (cp for long sequences, ep for a mixture of
experts) and the long-sequence layouts it must express, through `python -m dtk.plan`."""

from __future__ import annotations

import json

import pytest

from conftest import run_main
from dtk.config.compose import compose
from dtk.plan.cost.budget import Context
from dtk.plan.cost.search import Search
from dtk.plan.cost.splits import splits as _splits
from dtk.plan.plan import make_plan
from dtk.plan.shape import builtin_shape

H100_4X8 = ["cluster=slurm", "nodes=4", "tasks_per_node=8", "cluster.accelerator=h100-80gb"]
LLAMA_8B_131K = ["model.dim=4096", "model.num_layers=32", "model.num_heads=32", "model.ffn_hidden=14336",
                 "model.vocab_size=128256", "model.seq_len=131072", "train.global_batch=32"]


@pytest.mark.slow
def test_an_8b_model_at_131k_tokens_on_32_h100s_is_recommended_context_parallelism(tmp_path):
    proc = run_main("dtk.plan", *H100_4X8, *LLAMA_8B_131K, "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)["recommended"]
    assert rec["degrees"]["cp"] > 1, rec
    assert f"scheme.cp={rec['degrees']['cp']}" in rec["overrides"]
    # the recommended command, typed, plans with the same degrees
    again = run_main("dtk.plan", *H100_4X8, *LLAMA_8B_131K, *rec["overrides"], "--json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["plan"]["degrees"] == rec["degrees"]


def test_the_405b_context_parallel_layout_at_131k_plans_as_overrides(tmp_path):
    # Llama 3 405B's long-context stage: tp=8 inside a node, cp=16 over two nodes, FSDP over the rest
    proc = run_main("dtk.plan", "cluster=slurm", "nodes=1024", "tasks_per_node=8", "cluster.accelerator=h100-80gb",
                    "plan.layers=126", "plan.hidden=16384", "plan.heads=128", "plan.seq_len=131072",
                    "plan.vocab_size=128256", "train.global_batch=64", "+scheme=hybrid", "scheme.tp=8",
                    "scheme.cp=16", "scheme.pp=1", "scheme.dp_shard=64", "scheme.sequence_parallel=false",
                    "scheme.activation_checkpoint=full", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["plan"]["degrees"] == {"dp_replicate": 1, "pp": 1, "dp_shard": 64, "cp": 16, "tp": 8, "ep": 1}
    assert out["fits"] is True


def test_llama3_405b_long_context_layout_with_its_pipeline_plans_and_fits(tmp_path):
    # Llama 3 405B, long-context pre-training (the Llama 3 paper, Table 4): 16,384 H100s as
    # tp=8 x cp=16 x pp=16 x dp=8, 131,072-token sequences, 16 sequences per data-parallel rank
    proc = run_main("dtk.plan", "cluster=slurm", "nodes=2048", "tasks_per_node=8", "cluster.accelerator=h100-80gb",
                    "cluster.nics_per_node=8", "plan.layers=126", "plan.hidden=16384", "plan.heads=128",
                    "plan.seq_len=131072", "plan.vocab_size=128256", "train.global_batch=128", "+scheme=hybrid",
                    "scheme.tp=8", "scheme.cp=16", "scheme.pp=16", "scheme.dp_shard=8",
                    "scheme.sequence_parallel=false", "scheme.activation_checkpoint=full", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["plan"]["degrees"] == {"dp_replicate": 1, "pp": 16, "dp_shard": 8, "cp": 16, "tp": 8, "ep": 1}
    assert out["fits"] is True


def test_the_search_tries_cp_only_for_long_sequences_and_ep_only_for_experts():
    short = builtin_shape(_transformer([]))
    assert _splits(short, 8) == []
    long = builtin_shape(_transformer(["model.seq_len=32768"]))
    assert {s["cp"] for s in _splits(long, 8)} == {2, 4, 8} and {s["ep"] for s in _splits(long, 8)} == {1}
    moe = builtin_shape(_transformer(["model=moe", "model.num_experts=8"]))
    assert {s["ep"] for s in _splits(moe, 8)} == {2, 4, 8}


def test_a_mixture_of_experts_gets_expert_parallel_candidates():
    cfg = compose(["model=moe", "model.num_experts=8", *H100_4X8, "train.global_batch=64"])
    plan = make_plan(cfg, cwd="/tmp")
    from dtk.plan.cost.inputs import context
    from dtk.plan.cost.steptime import hardware_of

    ctx: Context = context(cfg, plan)
    found = Search(ctx, hardware_of(cfg.cluster, device="cuda", param_dtype="auto")).at(4)
    with_ep = [c for c in found if c.degrees.ep > 1]
    assert with_ep and all(f"scheme.ep={c.degrees.ep}" in c.overrides for c in with_ep)
    assert all(c.time is not None and "ep" in c.time.axes for c in with_ep)  # its all-to-all is in the step


def _transformer(overrides: list[str]):
    from dtk.config.convert import builtin_transformer

    t = builtin_transformer(compose(overrides).model)
    assert t is not None
    return t
