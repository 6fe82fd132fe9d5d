"""Compose, validate and plan: the login-node path. Fast; no torch, no processes started
except the real CLI for the contract checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conftest import dtk, run_main
from dtk.common.errors import UserError
from dtk.config import schema
from dtk.config.compose import compose, expand_sweep
from dtk.config.docs import field_docs, key_table
from dtk.plan.degrees import resolve_degrees
from dtk.plan.plan import make_plan


def test_every_schema_field_has_a_doc_string():
    for cls in [c for c in vars(schema).values() if dataclasses.is_dataclass(c)]:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a doc string: {missing}"


def test_key_table_lists_nested_and_group_keys():
    keys = {k for k, _, _ in key_table()}
    for key in ("nodes", "tasks_per_node", "train.steps", "train.global_batch", "train.micro_batch", "train.seed",
                "checkpoint.every", "checkpoint.keep", "run.root", "run.name", "submit.dry_run", "submit.wait",
                "model.dim", "cluster.partition", "optim.lr", "scheme.tp"):
        assert key in keys


def test_default_composes_to_ddp_on_two_local_workers(tmp_path):
    plan = make_plan(compose([]), cwd=tmp_path)
    assert plan.cluster_kind == "local"
    assert plan.world_size == 2
    assert plan.scheme == "ddp"
    assert plan.degrees.dp == 2
    assert plan.global_batch == plan.micro_batch * plan.grad_accum * plan.degrees.dp
    assert plan.run_dir.startswith(str(tmp_path / "runs"))


def test_scheme_is_appended_with_plus():
    cfg = compose(["+scheme=ddp", "tasks_per_node=4"])
    assert cfg.scheme.name == "ddp"
    assert make_plan(cfg).degrees.dp_replicate == 4


def test_run_identity_follows_semantic_keys_only():
    base = make_plan(compose([]))
    assert make_plan(compose([])).run_name == base.run_name
    # Where and how it runs does not change what the run is ...
    assert make_plan(compose(["tasks_per_node=4", "checkpoint.every=7", "train.micro_batch=16"])).run_name == base.run_name
    # ... what it computes does.
    assert make_plan(compose(["optim.lr=1e-4"])).run_name != base.run_name
    assert make_plan(compose(["train.seed=1"])).run_name != base.run_name
    assert make_plan(compose(["run.name=mine"])).run_name == "mine"


def test_plan_round_trips_through_json():
    from dtk.plan.plan import Plan

    for overrides in (["tasks_per_node=4"], ["+scheme=hybrid", "tasks_per_node=4", "scheme.pp=2", "model.num_layers=4"]):
        plan = make_plan(compose(overrides))
        again = Plan.from_json(plan.to_json())
        assert again == plan and isinstance(again.config, schema.Config)


def test_sweep_expands_to_cartesian_product():
    points = expand_sweep(["optim.lr=1e-3,3e-4", "train.seed=0,1", "nodes=1"])
    assert len(points) == 4
    assert ["optim.lr=0.001", "train.seed=0", "nodes=1"] in points


@pytest.mark.parametrize(
    "degrees, world, expected",
    [
        ({"dp_replicate": -1, "dp_shard": 1, "tp": 1, "pp": 1}, 8, (8, 1, 1, 1)),
        ({"dp_replicate": 2, "dp_shard": -1, "tp": 2, "pp": 1}, 8, (2, 2, 2, 1)),
        ({"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 2}, 8, (1, 2, 2, 2)),
    ],
)
def test_degrees_infer_the_one_free_axis(degrees, world, expected):
    d = resolve_degrees(schema.SchemeConfig(**degrees), world)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.pp) == expected


@pytest.mark.parametrize(
    "degrees, world, needle",
    [
        ({"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1}, 8, "= 4, but the world size"),
        ({"dp_replicate": -1, "dp_shard": -1, "tp": 1, "pp": 1}, 8, "at most one degree"),
        ({"dp_replicate": -1, "dp_shard": 1, "tp": 3, "pp": 1}, 8, "multiply to 3, which does not divide world size 8"),
    ],
)
def test_degrees_errors_show_the_arithmetic(degrees, world, needle):
    with pytest.raises(UserError, match=needle):
        resolve_degrees(schema.SchemeConfig(**degrees), world)


BAD_INPUT = [
    (["foo=1"], "unknown key 'foo'"),
    (["+foo=1"], "unknown key 'foo'"),
    (["train.stepz=3"], "unknown key 'train.stepz'"),
    (["nodes=abc"], "nodes=abc: expected integer"),
    (["train.steps=0"], "train.steps=0"),
    (["train.global_batch=31"], "train.global_batch=31 does not split over the data-parallel size 2"),
    (["train.global_batch=24", "train.micro_batch=8"], "train.global_batch=24 is not a multiple of train.micro_batch x data-parallel size = 8 x 2 = 16"),
    (["nodes=2"], "nodes=2: the local cluster is this one machine"),
    (["+scheme=nope"], "scheme=nope: no such scheme"),
    (["cluster=nope"], "cluster=nope: no such cluster"),
    (["model.num_heads=3"], "model.num_heads=3 does not divide model.dim=64"),
    (["optim.lr=-1"], "optim.lr=-1"),
    (["+scheme=pp", "scheme.pp_schedule=2f2b"], "scheme.pp_schedule=2f2b: expected one of gpipe, 1f1b, interleaved_1f1b"),
    (["model.tp_plan.output=colwise_outptu"], "model.tp_plan.output=colwise_outptu: expected one of colwise, rowwise,"),
    (["data.kind=csv"], "data.kind=csv: expected one of synthetic, hdf5, user"),
    # Every value a worker would otherwise find only after the queue wait:
    (["optim.name=sgd"], "optim.name=sgd: expected one of adamw"),
    (["+scheme=fsdp", "scheme.activation_checkpoint=some"], "scheme.activation_checkpoint=some: expected one of"),
    (["+scheme=fsdp", "scheme.param_dtype=fp8"], "scheme.param_dtype=fp8: expected one of"),
    (["model._target_=nosuch.module.build"], "model._target_=nosuch.module.build: no module nosuch.module on the Python"),
    (["train.micro_batch=0"], "train.micro_batch=0: expected a positive count of samples"),
    (["optim.grad_clip=-1"], "optim.grad_clip=-1.0: expected 0 (no clipping) or a positive norm"),
    (["checkpoint.every_minutes=-1"], "checkpoint.every_minutes=-1.0: expected 0 (off) or more"),
    (["checkpoint.memory_every=-5"], "checkpoint.memory_every=-5: expected 0 (the in-memory tier off) or a positive step"),
    (["checkpoint.max_failures=0"], "checkpoint.max_failures=0: expected a positive integer"),
    (["train.eval_every=10", "data.eval_samples=3"],
     "train.eval_every=10: the validation split has 512 samples (evaluating at most 3), fewer than one global batch"),
]

# Every closed-set key: a value outside its set stops while composing, naming the key, the
# value and every allowed value (dtk/config/choices.py).
BAD_CHOICES = [
    (["cluster.kind=pbs"], "cluster.kind=pbs: expected one of local, slurm"),
    (["data.kind=csv"], "data.kind=csv: expected one of synthetic, hdf5, user"),
    (["data.kind=hdf5"], "data.kind=hdf5 contradicts the data group chosen (synthetic); choose the group instead: data=hdf5"),
    (["optim.name=sgd"], "optim.name=sgd: expected one of adamw"),
    (["+scheme=fsdp", "scheme.data_parallel=zero3"], "scheme.data_parallel=zero3: expected one of ddp, fsdp"),
    (["+scheme=pp", "scheme.pp_schedule=1F1B"], "scheme.pp_schedule=1F1B: expected one of gpipe, 1f1b, interleaved_1f1b"),
    (["+scheme=fsdp", "scheme.activation_checkpoint=some"],
     "scheme.activation_checkpoint=some: expected one of none, selective, full"),
    (["+scheme=fsdp", "scheme.param_dtype=fp8"], "scheme.param_dtype=fp8: expected one of auto, float32, bfloat16, float16"),
    (["+scheme=fsdp", "scheme.reduce_dtype=half"], "scheme.reduce_dtype=half: expected one of auto, float32, bfloat16, float16"),
    (["model.tp_plan.output=colwise_outptu"],
     "model.tp_plan.output=colwise_outptu: expected one of colwise, rowwise, colwise_output, sequence_parallel,"
     " sequence_gather"),
    (["dist.backend=mpi"], "dist.backend=mpi: expected one of auto, nccl, gloo"),
    (["dist.device=tpu"], "dist.device=tpu: expected one of auto, cuda, cpu"),
]


@pytest.mark.parametrize("overrides, message", BAD_CHOICES, ids=[" ".join(o) for o, _ in BAD_CHOICES])
def test_a_value_outside_its_set_is_refused_while_composing(overrides, message):
    with pytest.raises(UserError) as exc:
        compose(overrides)
    assert str(exc.value) == message


def test_a_user_models_tp_styles_are_checked_too(tmp_path):
    """A user's model yaml has no schema, yet its tp_plan styles are checked on the login node."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text(
        "_target_: tests.models_for_tests.build\nvocab_size: 256\nseq_len: 32\nwidth: 8\ndepth: 2\n"
        "tp_plan:\n  head: colwise_outptu\n"
    )
    with pytest.raises(UserError) as exc:
        compose([f"hydra.searchpath=[file://{tmp_path}]", "model=mine"])
    assert str(exc.value).startswith("model.tp_plan.head=colwise_outptu: expected one of colwise, rowwise,")


def test_composed_config_is_typed_to_the_last_field():
    from dtk.config.choices import PipelineSchedule, TpStyle

    cfg = compose(["+scheme=pp", "model.num_layers=4"])
    assert isinstance(cfg, schema.Config)
    assert isinstance(cfg.model, schema.ModelConfig) and cfg.model.kwargs["num_layers"] == 4
    assert cfg.model.tp_plan["output"] is TpStyle.colwise_output
    assert cfg.scheme.pp_schedule is PipelineSchedule("1f1b")
    assert isinstance(cfg.data, schema.SyntheticDataConfig)
    assert compose([]).scheme == schema.SchemeConfig()  # no +scheme: the schema's (DDP)


def test_explicit_ddp_on_two_workers_plans_the_default_run():
    """`+scheme=ddp tasks_per_node=2` is the default job spelled out: the same scheme, world
    and run directory, so the default job's real run (tests/test_spine.py) runs it too."""
    explicit = make_plan(compose(["+scheme=ddp", "tasks_per_node=2", "train.steps=5"]), local_gpus=0)
    default = make_plan(compose(["train.steps=5"]), local_gpus=0)
    assert explicit.scheme == default.scheme == "ddp" and explicit.world_size == default.world_size == 2
    assert explicit.config_hash == default.config_hash and explicit.run_dir == default.run_dir


def test_plan_json_holds_the_config_as_the_user_spells_it():
    import json

    plan = make_plan(compose(["+scheme=fsdp", "model.num_layers=3"]))
    raw = json.loads(plan.to_json())["config"]
    assert raw["model"]["num_layers"] == 3 and raw["model"]["_target_"] == "dtk.models.transformer.build"
    assert raw["model"]["tp_plan"]["output"] == "colwise_output" and raw["scheme"]["data_parallel"] == "fsdp"


@pytest.mark.parametrize("overrides, needle", BAD_INPUT, ids=[" ".join(o) for o, _ in BAD_INPUT])
def test_bad_input_is_one_error_line_exit_2_and_nothing_written(tmp_path, overrides, needle):
    proc = run_main("dtk.submit", *overrides, f"run.root={tmp_path}/runs", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_submit_entry_point_prints_one_error_line_and_exits_2(tmp_path):
    """The real `python -m dtk.submit` process, once: what the in-process cases above check
    holds for the interpreter's exit code and stderr too."""
    proc = dtk("dtk.submit", "train.stepz=3", f"run.root={tmp_path}/runs", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "unknown key 'train.stepz'" in line, proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


def test_dry_run_prints_the_launch_and_creates_nothing(tmp_path):
    proc = run_main("dtk.submit", "+scheme=ddp", "tasks_per_node=2", "submit.dry_run=true", f"run.root={tmp_path}/runs",
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "would start 2 worker process(es)" in proc.stdout
    assert "DTK_RANK=1" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_submit_does_not_import_torch(tmp_path):
    proc = dtk("-X", "importtime", "-m", "dtk.submit", "submit.dry_run=true", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "dtk.plan.plan" in imported and "hydra" in imported  # importtime output is really there
    assert not any(name == "torch" or name.startswith("torch.") for name in imported)


def test_plan_help_lists_keys_with_docs():
    proc = run_main("dtk.plan", "--help")
    assert proc.returncode == 0
    assert "train.global_batch" in proc.stdout and "Samples per optimizer step" in proc.stdout


def test_an_unwritable_run_root_is_one_error_line_and_nothing_written(tmp_path):
    proc = run_main("dtk.submit", "run.root=/proc/sys/dtk-nope", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: run.root=/proc/sys/dtk-nope: cannot create a run directory there (")
    assert not Path("/proc/sys/dtk-nope").exists() and list(tmp_path.iterdir()) == []
