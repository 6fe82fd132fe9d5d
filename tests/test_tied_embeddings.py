"""A model whose output head is its token embedding (`model.tie_embeddings=true`) keeps one
parameter through the meta build, tensor parallelism and materialization, under every data
and tensor-parallel scheme, and trains as one process does (real gloo ranks: the tie's
single gradient sums both uses). Pipelines that would split the tie across stages are refused.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tie_checks import TIED, train_tied, train_tied_pp
from torch import nn

from conftest import require
from dtk.config.compose import compose
from dtk.models.build import build_model, materialize
from multirank import run_on_ranks

STEPS = 3
TIE = ["model.tie_embeddings=true", "model.num_layers=2", "model.vocab_size=64", "model.seq_len=16"]

# name -> (world size, overrides, parameter tolerance)
CASES = {
    "ddp": (2, ["+scheme=ddp"], 1e-5),
    "zero": (2, ["+scheme=zero"], 1e-5),
    "fsdp": (2, ["+scheme=fsdp"], 1e-5),
    "hsdp": (4, ["+scheme=hsdp", "scheme.dp_replicate=2"], 1e-5),
    "tp": (2, ["+scheme=tp", "scheme.dp_shard=1"], 1e-4),
    "tp_sequence_parallel_loss_parallel": (2, ["+scheme=tp", "scheme.dp_shard=1", "scheme.sequence_parallel=true"],
                                           1e-4),
    "hybrid_dp2_tp2": (4, ["+scheme=hybrid", "scheme.dp_shard=2", "scheme.tp=2"], 1e-4),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    (one,) = run_on_ranks(train_tied, 1, tmp_path_factory.mktemp("one"), TIE, STEPS)
    return one


def test_the_built_in_transformer_ties_its_head_to_its_embedding_through_materialize():
    cfg = compose(TIE)
    model = build_model(cfg.model, device="meta", seed=0)
    untied = build_model(compose(TIE[1:]).model, device="meta", seed=0)
    materialize([model], model_cfg=cfg.model, device=torch.device("cpu"), seed=0)
    assert model.get_parameter(TIED[0]) is model.get_parameter(TIED[1])
    assert model.get_parameter(TIED[0]).device.type == "cpu"
    assert len(list(model.parameters())) == len(list(untied.parameters())) - 1
    assert TIED[1] not in dict(model.named_parameters())


class TiedLM(nn.Module):
    """A user's model with no dtk hook: the head is tied as GPT-2 code ties it."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(32, 8)
        self.lm_head = nn.Linear(8, 32, bias=False)
        self.wte.weight = self.lm_head.weight  # tied the other way round, as nanoGPT does


def test_a_user_model_tied_the_other_way_round_keeps_its_tie_and_its_values():
    """Initialised from a seeded CPU build (no reset_parameter): the tie's one tensor gets
    the reference's values, which a fresh build reports under its first name only."""
    from dtk.config.schema import ModelConfig

    cfg = ModelConfig(_target_=f"{__name__}.TiedLM")
    model = build_model(cfg, device="meta", seed=3)
    materialize([model], model_cfg=cfg, device=torch.device("cpu"), seed=3)
    reference = build_model(cfg, device="cpu", seed=3)
    assert model.wte.weight is model.lm_head.weight
    torch.testing.assert_close(model.lm_head.weight, reference.lm_head.weight, rtol=0, atol=0)


# 2 ranks in the fast tier; 4 ranks and the sequence-parallel variant (seconds more each) in the slow one.
FAST = ("ddp", "zero", "fsdp", "tp")


@pytest.mark.dist
@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_a_tied_model_trains_as_one_process_under_every_scheme(name, reference, tmp_path):
    world, overrides, atol = CASES[name]
    ranks = run_on_ranks(train_tied, world, tmp_path, [*TIE, *overrides], STEPS)
    assert reference["one_object"] and reference["params"].keys() == ranks[0]["params"].keys()
    for rank, got in enumerate(ranks):
        assert got["one_object"], f"rank {rank}: {TIED} are two parameters"
        assert got["num_parameters"] == reference["num_parameters"]
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for key, want in reference["params"].items():
            torch.testing.assert_close(got["params"][key], want, rtol=1e-5, atol=atol, msg=lambda m, k=key: f"{k}: {m}")
    if "tp" in name:  # the vocab-parallel embedding and the column-parallel head: one Shard(0) DTensor
        assert "Shard(dim=0)" in ranks[0]["placements"], ranks[0]["placements"]


def test_a_pipeline_gives_the_last_stage_a_copy_that_starts_as_the_embedding():
    from dtk.models.ties import ELSEWHERE
    from dtk.parallel.pipeline import split_model
    from dtk.parallel.stage_ties import StageTie

    cfg = compose(TIE)
    stages = []
    for pp_rank in (0, 1):
        (stage,), _, ties = split_model(build_model(cfg.model, device="meta", seed=0), split_points=(),
                                        pp_rank=pp_rank, pp=2, virtual=1)
        materialize([stage], model_cfg=cfg.model, device=torch.device("cpu"), seed=0)
        stages.append(stage)
    assert ties == [StageTie(names=TIED, pp_ranks=(0, 1))]
    first, last = stages
    assert getattr(first, ELSEWHERE) == {} and getattr(last, ELSEWHERE) == {TIED[1]: TIED[0]}
    assert first.output is None and last.tok_embeddings is None
    torch.testing.assert_close(last.output.weight, first.tok_embeddings.weight, rtol=0, atol=0)


@pytest.mark.dist
@pytest.mark.slow
def test_a_tied_pipeline_sums_its_copies_gradients_and_counts_the_norm_once(reference, tmp_path):
    """2 stages on gloo ranks against one process: the same losses, gradient norms (the
    tie counted once; step 1's norm is above optim.grad_clip, so clipping acts) and weights;
    both copies of the tie step alike."""
    first, last = run_on_ranks(train_tied_pp, 2, tmp_path, TIE, STEPS)
    assert last["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for got in (first, last):
        assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    assert reference["norms"][0] > compose([]).optim.grad_clip  # clipped in step 1
    torch.testing.assert_close(last["params"][TIED[1]], first["params"][TIED[0]], rtol=0, atol=0)
    assert not last["params"][TIED[1]].equal(last["initial"][TIED[1]])  # it trained
    for got in (first, last):
        for key, value in got["params"].items():
            want = reference["params"][TIED[0] if key == TIED[1] else key]
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def test_the_planner_counts_a_tied_weight_once_as_the_workers_build_it():
    from dtk.plan.shape import builtin_config, builtin_shape

    cfg = compose(TIE)
    tied, untied = builtin_config(cfg.model), builtin_config(compose(TIE[1:]).model)
    assert tied is not None and untied is not None
    model = build_model(cfg.model, device="meta", seed=0)
    shape = builtin_shape(tied)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.params == builtin_shape(untied).params - tied.vocab_size * tied.dim
    assert [t.name for t in shape.tensors] == [name for name, _ in model.named_parameters()]


HF_TIED = ("model.embed_tokens.weight", "lm_head.weight")
HF_CASES = {"ddp": ["+scheme=ddp"], "fsdp": ["+scheme=fsdp"], "tp": ["+scheme=tp", "scheme.dp_shard=1"]}


@pytest.fixture(scope="module")
def hf_tied(tmp_path_factory) -> tuple[list[str], dict]:
    """A tiny Llama with tie_word_embeddings (as Llama-3.2-1B and Qwen2-0.5B have it), and
    its one-process run."""
    require(importlib.util.find_spec("transformers") is not None, "transformers is not installed (pip install '.[hf]')")
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("hf_tied")
    AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
    ).save_pretrained(root / "tiny")
    keys = ["model=hf", f"model.config={root / 'tiny'}", "model.seq_len=16", "model.vocab_size=64"]
    (one,) = run_on_ranks(train_tied, 1, root / "one", keys, STEPS, HF_TIED)
    return keys, one


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", list(HF_CASES))
def test_a_tied_hugging_face_model_trains_as_one_process(name, hf_tied, tmp_path):
    """tie_word_embeddings is honoured: embed_tokens and lm_head are one parameter (before,
    materialize split them and each got its own initial values)."""
    keys, reference = hf_tied
    ranks = run_on_ranks(train_tied, 2, tmp_path, [*keys, *HF_CASES[name]], STEPS, HF_TIED)
    assert reference["one_object"] and HF_TIED[1] not in reference["params"]
    for rank, got in enumerate(ranks):
        assert got["one_object"], f"rank {rank}: {HF_TIED} are two parameters"
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for key, want in reference["params"].items():
            torch.testing.assert_close(got["params"][key], want, rtol=1e-5, atol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


USER_YAML = """\
_target_: tests.models_for_tests.build_tied
vocab_size: 64
seq_len: 16
width: 32
depth: 2
expansion: 2
wrap_classes: [ResidualMLP]
tp_plan:
  embed: rowwise
  blocks.*.up: colwise
  blocks.*.down: rowwise
  head: colwise_output
"""
USER_TIED = ("embed.weight", "head.weight")
USER_CASES = {"fsdp": ["+scheme=fsdp"], "tp": ["+scheme=tp", "scheme.dp_shard=1"]}


@pytest.fixture(scope="module")
def user_tied(tmp_path_factory) -> tuple[list[str], dict]:
    """A user's tied model (tests/models_for_tests.py, no dtk hook: initialised from a seeded
    CPU build) by its yaml, and its one-process run."""
    conf = tmp_path_factory.mktemp("user_conf")
    (conf / "model").mkdir()
    (conf / "model" / "tied_lm.yaml").write_text(USER_YAML)
    keys = [f"hydra.searchpath=[file://{conf}]", "model=tied_lm"]
    (one,) = run_on_ranks(train_tied, 1, conf / "one", keys, STEPS, USER_TIED)
    return keys, one


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", list(USER_CASES))
def test_a_tied_user_model_trains_as_one_process(name, user_tied, tmp_path):
    keys, reference = user_tied
    ranks = run_on_ranks(train_tied, 2, tmp_path, [*keys, *USER_CASES[name]], STEPS, USER_TIED)
    assert reference["one_object"] and list(reference["params"]) == ["embed.weight", *list(reference["params"])[1:]]
    for rank, got in enumerate(ranks):
        assert got["one_object"], f"rank {rank}: {USER_TIED} are two parameters"
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for key, want in reference["params"].items():
            torch.testing.assert_close(got["params"][key], want, rtol=1e-5, atol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def test_the_export_learns_the_ties_from_the_model_and_says_when_it_cannot():
    from dtk.checkpoint.export import tied_names
    from dtk.config.convert import model_to_dict

    assert tied_names(model_to_dict(compose(TIE).model)) == {TIED[1]: TIED[0]}
    assert tied_names(model_to_dict(compose(TIE[1:]).model)) == {}
    assert tied_names({"_target_": "no_such_package.build"}) is None  # not importable here: unknown
    assert tied_names(None) is None


@pytest.mark.dist
def test_a_tp_plan_that_shards_the_head_and_not_the_embedding_is_refused_by_name(tmp_path):
    """The tie cannot be one tensor sharded for the head and whole for the embedding."""
    with pytest.raises(Exception, match=r"lays out the tied weights tok_embeddings.weight and output.weight differently"):
        run_on_ranks(train_tied, 2, tmp_path, [*TIE, "+scheme=tp", "scheme.dp_shard=1", "~model.tp_plan.tok_embeddings"],
                     1)
