"""python -m dtk.bench scaling: the arithmetic and table on given numbers, the command's
mistakes, and real runs locally and on the lab cluster."""

from __future__ import annotations

import json

import pytest

from conftest import dtk
from dtk.bench.__main__ import analyse, parse_sizes, render
from dtk.common.errors import UserError


def _row(size, step, **phases):
    full = dict.fromkeys(("data", "forward", "backward", "optimizer", "comm", "checkpoint", "straggler"), 0.0)
    full.update(phases)
    return {"size": size, "world_size": size, "step_time_s": step, "phases": full,
            "idle_share": sum(full[p] for p in ("data", "comm", "checkpoint", "straggler")) / step}


def test_speedup_efficiency_and_the_phase_that_stops_scaling():
    rows = [_row(1, 0.100, data=0.01, forward=0.04, backward=0.05),
            _row(2, 0.060, data=0.01, forward=0.02, backward=0.025, comm=0.005),
            _row(4, 0.045, data=0.01, forward=0.01, backward=0.0125, comm=0.0125)]
    result = analyse("nodes", rows)
    assert [round(r["speedup"], 3) for r in result["rows"]] == [1.0, 1.667, 2.222]
    assert round(result["rows"][2]["efficiency"], 3) == 0.556
    # At 4 nodes perfect scaling leaves data 2.5 ms and comm 0: data is 7.5 ms over, comm 12.5 ms.
    assert result["limit"]["phase"] == "comm"
    assert result["limit"]["excess_s"] == pytest.approx(0.0125)
    assert result["limit"]["lost_s"] == pytest.approx(0.045 - 0.025)
    text = render(result)
    assert "stops scaling: comm (12.5 ms per step beyond perfect scaling at nodes=4" in text
    assert "2.22x" in text and "55.6%" in text


@pytest.mark.parametrize("overrides, needle", [
    (["nodes=1"], "exactly one of nodes or tasks_per_node"),
    (["nodes=1,2", "tasks_per_node=1,2"], "exactly one"),
    (["nodes=1,x"], "expected whole numbers"),
    (["nodes=2,2"], "distinct sizes"),
    (["nodes=1,2", "run.name=x"], "leave run.name unset"),
])
def test_mistakes_in_the_sizes(overrides, needle):
    with pytest.raises(UserError, match=needle):
        parse_sizes(overrides)


def test_sizes_are_sorted_and_other_overrides_kept():
    assert parse_sizes(["train.steps=5", "tasks_per_node=4,1,2"]) == ("tasks_per_node", [1, 2, 4], ["train.steps=5"])


def test_a_mistake_is_one_error_line():
    proc = dtk("dtk.bench", "scaling", "nodes=1")
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and len(proc.stderr.splitlines()) == 1


def _check_output(proc, out, sizes):
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "speedup" in proc.stdout and "stops scaling:" in proc.stdout
    result = json.loads((out / "scaling.json").read_text())
    assert [r["size"] for r in result["rows"]] == sizes
    assert result["rows"][0]["speedup"] == 1.0 and all(r["step_time_s"] > 0 for r in result["rows"])
    from PIL import Image

    with Image.open(out / "scaling.png") as img:
        img.load()
        assert img.text["Description"].startswith("curves=")


@pytest.mark.slow
@pytest.mark.dist
def test_scaling_over_local_workers(tmp_path):
    out = tmp_path / "out"
    proc = dtk("dtk.bench", "scaling", "tasks_per_node=1,2", "train.steps=10", "train.global_batch=32",
               f"run.root={tmp_path}/runs", "--out", str(out), cwd=tmp_path)
    _check_output(proc, out, [1, 2])


@pytest.mark.slow
@pytest.mark.slurm
def test_scaling_on_the_lab(lab, tmp_path):
    out = tmp_path / "out"
    proc = dtk("dtk.bench", "scaling", "cluster=lab", "nodes=1,2", "tasks_per_node=1", "train.steps=10",
               "train.global_batch=32", f"run.root={tmp_path}/runs", "--out", str(out), cwd=tmp_path, timeout=900)
    _check_output(proc, out, [1, 2])
    assert json.loads((out / "scaling.json").read_text())["rows"][1]["world_size"] == 2
