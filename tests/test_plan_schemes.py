"""Schemes at plan time: every scheme file composes and plans, degrees come from the
command line, and impossible combinations stop before launch with exit 2 and the
arithmetic on the `error:` line. No torch, no processes beyond the CLI checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, run_main
from dtk.common.errors import UserError
from dtk.config.compose import compose
from dtk.plan.plan import make_plan

SCHEMES = sorted(p.stem for p in (REPO / "conf" / "scheme").glob("*.yaml"))


def plan(*overrides: str):
    return make_plan(compose(list(overrides)), cwd="/tmp")


def test_every_issue_scheme_has_a_file():
    assert set(SCHEMES) >= {"ddp", "zero", "fsdp", "hsdp", "tp", "pp", "hybrid"}


@pytest.mark.parametrize("name", SCHEMES)
def test_every_scheme_plans_on_four_workers_with_its_degree_keys(name):
    model = ["model=moe"] if name == "ep" else []  # expert parallelism splits a mixture of experts
    cfg = compose([*model, f"+scheme={name}", "tasks_per_node=4", "train.global_batch=16", "train.micro_batch=2",
                   "model.num_layers=4"])
    for key in ("dp_replicate", "dp_shard", "cp", "tp", "pp"):
        assert isinstance(getattr(cfg.scheme, key), int), key
    p = make_plan(cfg, cwd="/tmp")
    d = p.degrees
    assert d.dp_replicate * d.dp_shard * d.cp * d.tp * d.pp == 4
    assert p.scheme == name


def test_degrees_from_the_command_line():
    d = plan("+scheme=hybrid", "tasks_per_node=8", "scheme.tp=2", "scheme.pp=2", "model.num_layers=4",
             "train.micro_batch=8").degrees
    assert (d.dp_replicate, d.dp_shard, d.tp, d.pp) == (1, 2, 2, 2)
    d = plan("+scheme=hsdp", "tasks_per_node=4", "scheme.dp_replicate=2").degrees
    assert (d.dp_replicate, d.dp_shard) == (2, 2)
    d = plan("+scheme=tp", "tasks_per_node=4").degrees  # tp = workers per node
    assert (d.dp_shard, d.tp) == (1, 4)


def test_pipeline_microbatches_decide_the_micro_batch():
    p = plan("+scheme=pp", "tasks_per_node=2", "train.global_batch=32", "scheme.pp_microbatches=8")
    assert (p.micro_batch, p.grad_accum) == (4, 8)
    p = plan("+scheme=pp", "tasks_per_node=2", "train.global_batch=32")  # neither set: 2 x stages
    assert (p.micro_batch, p.grad_accum) == (8, 4)
    p = plan("+scheme=pp", "tasks_per_node=2", "train.global_batch=32", "train.micro_batch=2")
    assert (p.micro_batch, p.grad_accum) == (2, 16)


# (overrides, words the error must contain): one case per rule of the issue, and a few more.
INVALID = {
    "mesh product": (
        ["+scheme=hybrid", "tasks_per_node=4", "scheme.dp_shard=2", "scheme.tp=2", "scheme.pp=2"],
        ["dp_shard=2", "tp=2", "pp=2", "= 8", "world size", "is 4"],
    ),
    "tp vs heads": (
        ["+scheme=tp", "tasks_per_node=3", "train.global_batch=15"],
        ["scheme.tp=3", "model.num_heads=4", "4 / 3 = 1.33"],
    ),
    "tp vs hidden": (
        ["+scheme=tp", "tasks_per_node=4", "model.ffn_hidden=90"],
        ["scheme.tp=4", "model.ffn_hidden=90", "90 / 4 = 22.50"],
    ),
    "pp vs layers": (
        ["+scheme=pp", "tasks_per_node=4", "model.num_layers=2", "train.micro_batch=2"],
        ["pp x scheme.pp_virtual_stages = 4 x 1 = 4", "model.num_layers=2"],
    ),
    "batch vs micro-batches x dp": (
        ["+scheme=hybrid", "tasks_per_node=4", "scheme.tp=1", "scheme.pp=2", "scheme.dp_shard=2",
         "train.global_batch=20", "scheme.pp_microbatches=4"],
        ["train.global_batch=20", "pp_microbatches x data-parallel size = 4 x 2 = 8"],
    ),
    "batch vs micro batch x dp": (
        ["+scheme=fsdp", "tasks_per_node=4", "train.global_batch=24", "train.micro_batch=4"],
        ["train.global_batch=24", "4 x 4 = 16"],
    ),
    "1f1b needs a micro-batch per stage": (
        ["+scheme=pp", "tasks_per_node=4", "model.num_layers=4", "train.global_batch=8", "train.micro_batch=4"],
        ["2 micro-batches", "pp=4"],
    ),
    "ddp cannot shard": (
        ["+scheme=ddp", "tasks_per_node=4", "scheme.dp_shard=2"],
        ["scheme.data_parallel=ddp", "dp_shard=2"],
    ),
    "split points vs stages": (
        ["+scheme=pp", "tasks_per_node=2", "model.split_points=[layers.1,layers.2]"],
        ["2 entries = 3 stages", "= 2"],
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_combination_is_a_user_error_with_the_arithmetic(case):
    overrides, words = INVALID[case]
    with pytest.raises(UserError) as exc:
        plan(*overrides)
    for word in words:
        assert word in str(exc.value), f"{word!r} not in: {exc.value}"


@pytest.mark.parametrize("case", ["mesh product", "tp vs heads", "pp vs layers", "batch vs micro-batches x dp"])
def test_invalid_combination_exits_2_before_launch(case, tmp_path: Path):
    overrides, words = INVALID[case]
    proc = run_main("dtk.submit", *overrides, f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0]
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir()), "nothing may be written before the plan holds"


def test_pipeline_stages_split_blocks_evenly_or_at_the_given_points():
    import torch

    from dtk.models.transformer import build
    from dtk.parallel.pipeline import stage_units

    with torch.device("meta"):
        model = build(vocab_size=16, dim=8, num_layers=5, num_heads=2)
    stages = stage_units(model, split_points=(), num_stages=2)
    assert stages == [
        ["tok_embeddings", "pos_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "layers.4", "norm", "output"],
    ]
    stages = stage_units(model, split_points=("layers.1", "layers.4"), num_stages=3)
    assert [s[0] for s in stages] == ["tok_embeddings", "layers.1", "layers.4"]
    with pytest.raises(ValueError, match="not units of the model"):
        stage_units(model, split_points=("layers.9",), num_stages=2)


def test_zero_partition_balances_sizes_deterministically():
    import torch

    from dtk.parallel.zero import partition

    params = [torch.empty(n) for n in (100, 10, 60, 50, 5, 5)]
    owner = partition(params, 2)
    load = [sum(p.numel() for p, o in zip(params, owner, strict=True) if o == r) for r in range(2)]
    assert load == [115, 115]
    assert partition(params, 2) == owner
