"""Hugging Face models in one process: built on the meta device and materialized by dtk,
initialised the same way whatever the sharding, loaded from safetensors, and told how to
parallelize by the model itself. Needs transformers and safetensors (the hf extra)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import require

# Llama in the fast tier; the other families (same code path, other classes) in the slow one.
FAMILIES = ("llama", pytest.param("qwen2", marks=pytest.mark.slow), pytest.param("mistral", marks=pytest.mark.slow))


@pytest.fixture(autouse=True)
def _needs_hf():
    require(
        importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("safetensors") is not None,
        "transformers and safetensors are not installed (pip install '.[hf]')",
    )


def tiny_config(family: str, folder, **extra):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        family, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **extra,
    )
    cfg.save_pretrained(folder)
    return cfg


def model_cfg(**keys):
    from dtk.config.convert import model_config

    return model_config({"_target_": "dtk.models.hf.build", "seq_len": 16, **keys})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_meta_build_materializes_to_the_seeded_weights_and_returns_logits(family, tmp_path):
    from dtk.models.build import build_model, materialize

    tiny_config(family, tmp_path)
    cfg = model_cfg(config=str(tmp_path))
    on_cpu = build_model(cfg, device="cpu", seed=3)
    meta = build_model(cfg, device="meta", seed=0)
    materialize([meta], model_cfg=cfg, device=torch.device("cpu"), seed=3)
    tokens = torch.randint(0, 128, (2, 16))
    logits = on_cpu(tokens)
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 16, 128)
    assert torch.equal(meta(tokens), logits)
    other = build_model(cfg, device="cpu", seed=4)
    assert not torch.equal(other(tokens), logits)
    # transformers' own initialisation: normal(0, initializer_range) matrices, unit norms,
    # the rotary frequencies of the config.
    q = dict(on_cpu.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - 0.02) < 0.004
    assert torch.equal(dict(on_cpu.named_parameters())["model.norm.weight"], torch.ones(32))
    assert torch.allclose(on_cpu.model.rotary_emb.inv_freq[:2], torch.tensor([1.0, 0.1]))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_init_from_loads_the_saved_weights(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from dtk.models.build import build_model, materialize

    cfg = tiny_config(family, tmp_path / "cfg")
    saved = AutoModelForCausalLM.from_config(cfg)
    saved.save_pretrained(tmp_path / "weights")
    loaded = model_cfg(init_from=str(tmp_path / "weights"))
    meta = build_model(loaded, device="meta", seed=0)
    materialize([meta], model_cfg=loaded, device=torch.device("cpu"), seed=99)
    tokens = torch.randint(0, 128, (2, 16))
    assert torch.equal(meta(tokens), saved(tokens).logits)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_plan_comes_from_the_model(family, tmp_path):
    from dtk.config.choices import TpStyle
    from dtk.models.build import build_model
    from dtk.parallel.tp import check_tp_plan
    from dtk.parallel.units import wrap_units

    tiny_config(family, tmp_path)
    model = build_model(model_cfg(config=str(tmp_path)), device="meta", seed=0)
    layer = f"{type(model.model.layers[0]).__name__}"
    assert model.dtk_wrap_classes == (layer,)
    assert [name for name, _ in wrap_units(model, model.dtk_wrap_classes)] == ["model.layers.0", "model.layers.1"]
    plan = model.dtk_tp_plan
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_output" and set(plan.values()) <= set(TpStyle.values())
    check_tp_plan(model, plan)  # every pattern names modules of the model


def test_missing_config_and_weights_are_user_errors(tmp_path):
    from dtk.common.errors import UserError
    from dtk.models.build import build_model

    with pytest.raises(UserError, match="model.config="):
        build_model(model_cfg(config=str(tmp_path / "nowhere")), device="meta", seed=0)
    tiny_config("llama", tmp_path)
    with pytest.raises(UserError, match="no model.safetensors"):
        build_model(model_cfg(init_from=str(tmp_path)), device="meta", seed=0)
    with pytest.raises(UserError, match="max_position_embeddings=64"):
        build_model(model_cfg(config=str(tmp_path), seq_len=128), device="meta", seed=0)


def test_model_hf_by_config_takes_the_models_own_plan_unless_the_yaml_gives_one(tmp_path):
    from dtk.common.errors import UserError
    from dtk.config.compose import compose
    from dtk.models.build import ParallelSpec, build_model
    from dtk.parallel.tp import check_tp_plan
    from dtk.plan.plan import make_plan

    tiny_config("llama", tmp_path)
    job = ["model=hf", f"model.config={tmp_path}", "model.seq_len=16", "model.vocab_size=128"]
    cfg = compose(job)
    make_plan(cfg)
    model = build_model(cfg.model, device="meta", seed=0)
    spec = ParallelSpec.from_config(cfg.model).with_model_defaults(model)
    assert spec.wrap_classes == ("LlamaDecoderLayer",) and spec.tp_plan == model.dtk_tp_plan
    own = compose([*job, "model.wrap_classes=[LlamaMLP]", "+model.tp_plan={lm_head: colwise_output}"]).model
    spec = ParallelSpec.from_config(own).with_model_defaults(model)
    assert spec.wrap_classes == ("LlamaMLP",) and spec.tp_plan == {"lm_head": "colwise_output"}
    # A style of transformers' that dtk has no equivalent of is refused when tp would use it.
    with pytest.raises(UserError, match="model.tp_plan: the model's own plan gives lm_head the style local_rowwise"):
        check_tp_plan(model, {**model.dtk_tp_plan, "lm_head": "unsupported:local_rowwise"})
    with pytest.raises(UserError, match="model.vocab_size=512: the data's token ids must fit"):
        build_model(compose([*job, "model.vocab_size=512"]).model, device="meta", seed=0)
    with pytest.raises(UserError, match="scheme.pp=2 with model=hf"):
        make_plan(compose([*job, "+scheme=pp", "tasks_per_node=2"]))
