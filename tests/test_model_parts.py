"""Mistakes in the model's keys stop on the login node, not on the workers after the queue:
a factory argument the model does not take (a built-in's from a torch-free table, a user
factory's in the planner's subprocess), `+scheme=tp` on a model without a tensor-parallel
plan, `wrap_classes` and `split_points` that name nothing, and out-of-range optimizer and
Slurm values. The torch-free tables are held against the real modules and signatures."""

from __future__ import annotations

import inspect

import pytest

from dtk.common.errors import UserError
from dtk.config.convert import builtin_transformer, model_config
from dtk.config.schema import TransformerConfig
from dtk.plan.parts import BUILTIN_ARGUMENTS
from dtk.plan.shape import builtin_modules

USER_MODEL_YAML = """\
_target_: tests.models_for_tests.build
vocab_size: 256
seq_len: 32
width: 16
depth: 2
expansion: 2
wrap_classes: [ResidualMLP]
"""


def plan(overrides: list[str], tmp_path, user_model: bool = False):
    from dtk.submit.__main__ import plan_points

    extra = []
    if user_model:
        (tmp_path / "conf" / "model").mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / "model" / "mlp.yaml").write_text(USER_MODEL_YAML)
        extra = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "model=mlp"]
    return plan_points([*extra, *overrides, f"run.root={tmp_path / 'runs'}"], multirun=False)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_builtin_transformers_modules_are_the_real_ones(dropout):
    from dtk.models.build import build_model

    cfg = TransformerConfig(num_layers=3, dropout=dropout)
    model = build_model(model_config(cfg), device="meta", seed=0)
    real = tuple((name, type(m).__name__, f"{type(m).__module__}.{type(m).__qualname__}")
                 for name, m in model.named_modules())
    assert builtin_modules(cfg) == real


def test_the_builtin_factories_arguments_are_their_signatures():
    from dtk.models import hf
    from dtk.models.transformer import Transformer

    def arguments(fn, skip=("self",)):
        params = [p for n, p in inspect.signature(fn).parameters.items() if n not in skip]
        return (tuple(p.name for p in params if p.default is inspect.Parameter.empty),
                tuple(p.name for p in params if p.default is not inspect.Parameter.empty))

    required, optional = arguments(Transformer.__init__)
    # the factory fills every argument it is not given from the schema's defaults
    assert BUILTIN_ARGUMENTS["dtk.models.transformer.build"] == ((), required + optional)
    assert BUILTIN_ARGUMENTS["dtk.models.hf.build"] == arguments(hf.build)


def test_a_misspelled_argument_of_a_builtin_factory_stops_before_any_import(tmp_path):
    # model=hf has a schema of its own: an unknown key stops at compose, naming the keys it takes
    with pytest.raises(UserError, match=r"unknown key 'model.num_layerz'; known keys here: .*seq_len"):
        plan(["model=hf", "model.config=/nowhere", "model.vocab_size=256", "+model.num_layerz=2"], tmp_path)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # the planner counts the user model in a subprocess (a torch import)
def test_a_misspelled_argument_of_a_user_factory_is_an_error_not_a_note(tmp_path, capsys):
    with pytest.raises(UserError, match=r"model._target_=tests.models_for_tests.build: its keys do not fit the"
                                        r" factory: got an unexpected keyword argument 'widht'; it takes vocab_size"):
        plan(["+model.widht=3"], tmp_path, user_model=True)
    assert "note:" not in capsys.readouterr().err
    with pytest.raises(UserError, match=r"scheme.tp=2: model._target_=tests.models_for_tests.build has no"
                                        r" tensor-parallel plan; give model.tp_plan"):
        plan(["+scheme=tp", "tasks_per_node=2"], tmp_path, user_model=True)


def user_model(**changes):
    import yaml

    return model_config({**yaml.safe_load(USER_MODEL_YAML), **changes})


def test_a_user_factorys_keys_are_bound_to_its_signature_where_the_planner_counts_it():
    """What the planner's subprocess runs (dtk.plan.count_model.count), in this process."""
    from dtk.parallel.count import count

    with pytest.raises(UserError, match=r"got an unexpected keyword argument 'widht'; it takes vocab_size, width"):
        count(user_model(widht=3))
    with pytest.raises(UserError, match=r"its keys do not fit the factory: missing a required argument: 'depth'"):
        count(model_config({k: v for k, v in user_model().kwargs.items() if k != "depth"}
                           | {"_target_": "tests.models_for_tests.build"}))
    with pytest.raises(UserError, match=r"building it failed: TypeError"):
        count(user_model(width="wide"))


def test_a_user_models_parallel_keys_against_its_counted_modules():
    from dtk.parallel.count import count
    from dtk.plan.degrees import Degrees
    from dtk.plan.parts import check_parts
    from dtk.plan.shape import shape_from_counted

    shape = shape_from_counted(count(user_model()))
    target = "model._target_=tests.models_for_tests.build"

    def check(wrap=("ResidualMLP",), tp_plan=None, split_points=(), tp=1, pp=1):
        check_parts(shape, wrap_classes=wrap, tp_plan=tp_plan or {}, split_points=split_points,
                    degrees=Degrees(dp_replicate=1, pp=pp, dp_shard=1, tp=tp), pp_virtual_stages=1, target=target)

    check()  # its own keys fit
    check(wrap=("tests.models_for_tests.ResidualMLP",), tp_plan={"blocks.*.up": "colwise"}, tp=2,
          split_points=("blocks.1",), pp=2)
    with pytest.raises(UserError, match=r"scheme.tp=2: .* has no tensor-parallel plan"):
        check(tp=2)
    with pytest.raises(UserError, match=r"the pattern blocks.\*.upp matches no module"):
        check(tp_plan={"blocks.*.upp": "colwise"}, tp=2)
    with pytest.raises(UserError, match=r"model.wrap_classes: ResidualMLPs is no class of a module of .* its"
                                        r" classes: Embedding, LayerNorm, Linear, MlpLM, ModuleList, ResidualMLP"):
        check(wrap=("ResidualMLPs",))
    with pytest.raises(UserError, match=r"model.split_points: blocks.9 is no pipeline unit of .* its units: embed,"):
        check(split_points=("blocks.9",), pp=2)
    with pytest.raises(UserError, match=r"3 pipeline stages, but .* has 2 repeated blocks"):
        check(pp=3)


@pytest.mark.parametrize(("overrides", "message"), [
    (["+scheme=pp", "model.split_points=[layers.9]"],
     r"model.split_points: layers.9 is no pipeline unit of model._target_=dtk.models.transformer.build; its units:"
     r" tok_embeddings, pos_embeddings, layers.0, layers.1, norm, output"),
    (["model.split_points=[layers.9]"], r"model.split_points: layers.9 is no pipeline unit"),  # pp=1 too
    (["+scheme=pp", "model.split_points=[tok_embeddings]"], r"in forward order, each once, after the first unit"),
    (["+scheme=tp", "+model.tp_plan={lyers.0.attn.wq:colwise}"],
     r"model.tp_plan: the pattern lyers.0.attn.wq matches no module of model._target_=dtk.models.transformer.build"),
    (["model.wrap_classes=[Blok]"], r"model.wrap_classes: Blok is no class of a module .* Block, Embedding"),
])
def test_builtin_parallel_keys_that_name_nothing(overrides, message, tmp_path):
    with pytest.raises(UserError, match=message):
        plan(overrides, tmp_path)


@pytest.mark.parametrize(("override", "message"), [
    ("optim.beta1=1.5", r"optim.beta1=1.5: expected a value in \[0, 1\)"),
    ("optim.beta2=-0.1", r"optim.beta2=-0.1: expected a value in \[0, 1\)"),
    ("optim.weight_decay=-1", r"optim.weight_decay=-1.0: expected 0 \(none\) or more"),
    ("optim.eps=0", r"optim.eps=0.0: expected a small positive number"),
    ("optim.min_lr_ratio=1.5", r"optim.min_lr_ratio=1.5: expected a fraction of optim.lr in \[0, 1\]"),
    ("cluster.time_min=0", r"cluster.time_min=0: expected a positive integer"),
    ("cluster.cpus_per_task=0", r"cluster.cpus_per_task=0: expected a positive integer"),
    ("cluster.device_memory_gb=0", r"cluster.device_memory_gb=0.0: expected a positive number"),
    ("cluster.peak_tflops=-3", r"cluster.peak_tflops=-3.0: expected a positive number"),
    ("cluster.mem_gb=0", r"cluster.mem_gb=0: expected a positive integer"),
    ("fault.signal_lead_floor_s=0", r"fault.signal_lead_floor_s=0: expected a positive integer"),
    ("fault.straggler_factor=0.5", r"fault.straggler_factor=0.5: expected 0 \(off\) or a factor above 1"),
    ("train.eval_every=-1", r"train.eval_every=-1: expected 0"),
])
def test_values_out_of_their_range(override, message, tmp_path):
    with pytest.raises(UserError, match=message):
        plan([override], tmp_path)


def test_the_defaults_and_the_shipped_parallel_keys_pass(tmp_path):
    for scheme in ("ddp", "fsdp", "tp", "pp"):
        [point] = plan([f"+scheme={scheme}", "tasks_per_node=2", "train.micro_batch=16"], tmp_path)
        assert builtin_transformer(point.plan.config.model) is not None


def test_a_dry_run_checks_the_run_root(tmp_path):
    from dtk.submit.__main__ import main

    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"run.root=.*file: cannot create a run directory there \(Not a directory"):
        main([f"run.root={tmp_path / 'file'}", "submit.dry_run=true"])


def test_what_only_a_worker_sees_is_a_user_error_there():
    """The same mistakes, where a worker meets them (a plan made without building the model,
    plan.params): UserError, which the worker turns into exit 2 and its `error:` line."""
    from dtk.config.choices import ActivationCheckpoint
    from dtk.models.build import build_model
    from dtk.parallel.ac import apply_ac
    from dtk.parallel.pipeline import stage_units
    from dtk.parallel.tp import check_tp_plan

    with pytest.raises(UserError, match="its keys do not fit the factory: got an unexpected keyword argument 'widht'"):
        build_model(user_model(widht=3), device="meta", seed=0)
    model = build_model(user_model(), device="meta", seed=0)
    with pytest.raises(UserError, match="scheme.tp > 1 needs model.tp_plan"):
        check_tp_plan(model, {})
    with pytest.raises(UserError, match="pattern 'blocks.\\*.upp' matches no module"):
        check_tp_plan(model, {"blocks.*.upp": "colwise"})
    with pytest.raises(UserError, match=r"model.split_points \['blocks.9'\] are not units of the model"):
        stage_units(model, split_points=("blocks.9",), num_stages=2)
    with pytest.raises(UserError, match="model.wrap_classes=\\['Nope'\\] matches no module"):
        apply_ac(model, mode=ActivationCheckpoint.full, wrap_classes=("Nope",))
