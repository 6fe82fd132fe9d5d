"""Rules the torch-free planner (dtk/plan/) owns and the torch side follows: the pipeline stage
cut, the ZeRO-1 owner of a parameter, the SwiGLU width, the rank grid, the newest committed
checkpoint. The torch side calls the planner's function; these tests hold the planner's view
of the model (dtk.plan.shape.builtin_shape) equal to the model the workers build, and the
copies that still exist equal to the one source."""

from __future__ import annotations

import dataclasses

import pytest

from dtk.common.rundir import MANIFEST, RunDir
from dtk.common.storage import checkpoints_of, committed_steps, latest_committed_step
from dtk.config.schema import TransformerConfig
from dtk.plan.degrees import Axis, Degrees
from dtk.plan.layout import axis_groups, coords, rank_of, stage_units, zero1_owner
from dtk.plan.shape import builtin_shape, ffn_hidden_size

torch = pytest.importorskip("torch")

SMALL = dict(vocab_size=32, dim=24, num_layers=5, num_heads=2, seq_len=16)


def meta_transformer(**keys):
    from dtk.models.transformer import build

    with torch.device("meta"):
        return build(**keys)


@pytest.mark.parametrize("split_points, num_stages", [((), 2), ((), 5), (("layers.1", "layers.4"), 3)])
def test_the_model_is_cut_into_the_stages_the_planner_lays_out(split_points, num_stages):
    from dtk.parallel.pipeline import stage_units as cut_model

    planned = stage_units(builtin_shape(TransformerConfig(**SMALL)).units, split_points, num_stages)
    assert cut_model(meta_transformer(**SMALL), split_points=split_points, num_stages=num_stages) == planned


@pytest.mark.parametrize("num_ranks", [2, 3, 8])
def test_zero1_owners_of_the_real_parameters_are_the_planned_ones(num_ranks):
    from dtk.parallel.zero import partition

    model = meta_transformer(**SMALL)
    planned = builtin_shape(TransformerConfig(**SMALL)).tensors
    assert [t.name for t in planned] == [n for n, _ in model.named_parameters()]
    assert partition(list(model.parameters()), num_ranks) == list(zero1_owner(tuple(t.numel for t in planned), num_ranks))


@pytest.mark.parametrize("dim, ffn_hidden", [(24, 0), (64, 0), (100, 0), (64, 96)])
def test_the_feed_forward_is_as_wide_as_the_planner_says(dim, ffn_hidden):
    model = meta_transformer(**dict(SMALL, dim=dim, ffn_hidden=ffn_hidden, num_heads=4))
    width = ffn_hidden_size(dim, ffn_hidden)
    assert model.get_submodule("layers.0.mlp.w1").weight.shape == (width, dim)
    planned = builtin_shape(TransformerConfig(**dict(SMALL, dim=dim, ffn_hidden=ffn_hidden, num_heads=4)))
    assert sum(t.numel for t in planned.tensors) == sum(p.numel() for p in model.parameters())


def test_rank_coordinates_and_groups_are_one_grid():
    d = Degrees(dp_replicate=2, pp=3, dp_shard=2, tp=2)
    assert [rank_of(coords(r, d), d) for r in range(d.world)] == list(range(d.world))
    # DeviceMesh's groups are the slices of arange(world).view(grid) along the axis.
    grid = torch.arange(d.world).view(*(d.of(a) for a in Axis))
    for k, axis in enumerate(Axis):
        expected = sorted(g.tolist() for g in grid.movedim(k, -1).reshape(-1, d.of(axis)))
        assert sorted(axis_groups(d, axis.value)) == expected


def test_the_newest_committed_checkpoint_is_one_rule(tmp_path):
    from dtk.driver.record import latest_checkpoint_step as recorded  # both drivers' (dtk.driver.core)

    run = RunDir(tmp_path)
    assert latest_committed_step(checkpoints_of(run)) is None and recorded(run) is None
    for step, committed in [(2, True), (4, True), (6, False)]:
        folder = run.checkpoint_dir(step)
        folder.mkdir(parents=True)
        if committed:
            (folder / MANIFEST).write_text("{}")
    assert committed_steps(checkpoints_of(run)) == [2, 4]
    # The driver core resumes from RunDir's rule.
    assert latest_committed_step(checkpoints_of(run)) == recorded(run) == 4


def test_the_budget_reads_the_typed_scheme():
    from dtk.config.choices import ActivationCheckpoint, DataParallel
    from dtk.config.schema import SchemeConfig
    from dtk.plan.cost.memory import scheme_config

    raw = dataclasses.asdict(SchemeConfig()) | {"data_parallel": "fsdp", "activation_checkpoint": "full", "tp": 2}
    scheme = scheme_config(raw)
    assert scheme.data_parallel is DataParallel.fsdp and scheme.activation_checkpoint is ActivationCheckpoint.full
    assert scheme.tp == 2 and scheme_config(dataclasses.asdict(SchemeConfig())) == SchemeConfig()
