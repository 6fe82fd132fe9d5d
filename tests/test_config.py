"""Compose, validate and plan: the login-node path. Fast; no torch, no processes started
except the real CLI for the contract checks."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import dtk
from dtk.config import schema
from dtk.config.compose import compose, expand_sweep
from dtk.config.docs import field_docs, key_table
from dtk.errors import UserError
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
    assert cfg["scheme"]["name"] == "ddp"
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
    plan = make_plan(compose(["tasks_per_node=4"]))
    from dtk.plan.plan import Plan

    assert Plan.from_json(plan.to_json()) == plan


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
    d = resolve_degrees(degrees, world)
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
        resolve_degrees(degrees, world)


BAD_INPUT = [
    (["foo=1"], "unknown key 'foo'"),
    (["+foo=1"], "unknown key 'foo'"),
    (["train.stepz=3"], "unknown key 'train.stepz'"),
    (["nodes=abc"], "nodes=abc: expected integer"),
    (["train.steps=0"], "train.steps=0"),
    (["train.global_batch=31"], "train.global_batch=31 does not split over the data-parallel size 2"),
    (["train.global_batch=24", "train.micro_batch=8"], "train.global_batch=24 is not a multiple of train.micro_batch × data-parallel size = 8 × 2 = 16"),
    (["nodes=2"], "nodes=2: the local cluster is this one machine"),
    (["+scheme=nope"], "scheme=nope: no such scheme"),
    (["cluster=nope"], "cluster=nope: no such cluster"),
    (["model.n_heads=3"], "model.n_heads=3 does not divide model.dim=64"),
    (["optim.lr=-1"], "optim.lr=-1"),
]


@pytest.mark.parametrize("overrides, needle", BAD_INPUT, ids=[" ".join(o) for o, _ in BAD_INPUT])
def test_bad_input_is_one_error_line_exit_2_and_nothing_written(tmp_path, overrides, needle):
    proc = dtk("dtk.submit", *overrides, f"run.root={tmp_path}/runs", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_dry_run_prints_the_launch_and_creates_nothing(tmp_path):
    proc = dtk("dtk.submit", "+scheme=ddp", "tasks_per_node=2", "submit.dry_run=true", f"run.root={tmp_path}/runs", cwd=tmp_path)
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
    proc = dtk("dtk.plan", "--help")
    assert proc.returncode == 0
    assert "train.global_batch" in proc.stdout and "Samples per optimizer step" in proc.stdout
