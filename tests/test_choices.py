"""Every allowed value of the schema means something in the code that consumes it: the
tables of parallel/, train/ and config/ cover each Enum of dtk/config/choices.py, and the
mesh axes are one list (the scheme's degree keys, Degrees, the DeviceMesh's dimensions)."""

from __future__ import annotations

import dataclasses

from dtk.config.choices import (
    TRACKER_MODULES,
    DataKind,
    Dtype,
    GradCompression,
    MatmulPrecision,
    OptimizerName,
    PipelineSchedule,
    SyncDtype,
    TpStyle,
    Tracker,
)
from dtk.config.schema import DATA_SCHEMAS, SchemeConfig
from dtk.plan.degrees import Axis, CarvedAxis, Degrees


def test_every_choice_has_its_meaning_in_the_code():
    from dtk.parallel.pipeline import SCHEDULES
    from dtk.parallel.precision import DTYPES, MATMUL
    from dtk.parallel.tp import STYLES
    from dtk.train.optim import OPTIMIZERS

    assert set(STYLES) == set(TpStyle)
    assert set(SCHEDULES) == set(PipelineSchedule)
    assert set(DTYPES) | {Dtype.auto} == set(Dtype)
    assert set(MATMUL) | {MatmulPrecision.auto} == set(MatmulPrecision)
    assert set(OPTIMIZERS) == set(OptimizerName)
    assert set(DATA_SCHEMAS) == set(DataKind)
    assert set(TRACKER_MODULES) == set(Tracker)
    from dtk.parallel.compression import HOOKS

    assert set(HOOKS) == set(GradCompression)
    from dtk.train.sync import DTYPES as SYNC_DTYPES

    assert set(SYNC_DTYPES) == set(SyncDtype)


def test_the_mesh_axes_are_one_list():
    # Degrees keeps cp last (default 1, so positional Degrees(dp_replicate, pp, dp_shard, tp)
    # stands); the grid's order is Axis's, which places cp between dp_shard and tp.
    # The carved axes (ep) follow, one field each.
    fields = [f.name for f in dataclasses.fields(Degrees)]
    grid = fields[:len(Axis.values())]
    assert sorted(grid) == sorted(Axis.values()) and grid[-1] == "cp"
    assert [f for f in grid if f != "cp"] == [a for a in Axis.values() if a != "cp"]
    assert fields[len(grid):] == list(CarvedAxis.values())
    assert set(Axis.values()) | set(CarvedAxis.values()) <= {f.name for f in dataclasses.fields(SchemeConfig)}


def test_a_choice_reads_as_its_string():
    schedule = PipelineSchedule("interleaved_1f1b")
    assert schedule == "interleaved_1f1b" and f"{schedule}" == "interleaved_1f1b" and str(schedule) == schedule.value
    assert TpStyle.colwise.values()[0] == "colwise"
