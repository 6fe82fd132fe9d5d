"""`python -m dtk.bench matmul`: this machine's matmul rate at each GEMM width, written where
the planner reads it (cluster.matmul_rates), and the planner's efficiency by width from it."""

from __future__ import annotations

import json

import pytest

from conftest import run_main
from dtk.config.schema import ClusterConfig
from dtk.plan.accelerators import ACCELERATORS
from dtk.plan.cost.steptime import hardware_of, matmul_shares


def test_the_command_measures_this_machine_and_the_planner_reads_its_folder(tmp_path):
    from dtk.bench.matmul import CPU_WIDTHS

    out = tmp_path / "matmul"
    r = run_main("dtk.bench", "matmul", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    files = list(out.glob("matmul-*.json"))
    assert len(files) == 1
    written = json.loads(files[0].read_text())
    assert written["device"] == "cpu" and [row["width"] for row in written["rows"]] == list(CPU_WIDTHS)
    assert all(row["tflops"] > 0 for row in written["rows"])
    assert f"cluster.matmul_rates={out}" in r.stdout
    cluster = ClusterConfig(accelerator="a100-80gb", matmul_rates=str(out))
    hw = hardware_of(cluster, device="cuda", param_dtype="auto")
    widest = max(row["tflops"] for row in written["rows"] if row["width"] == CPU_WIDTHS[-1])
    assert hw.speeds.shares == tuple((row["width"], pytest.approx(row["tflops"] / widest)) for row in written["rows"])
    assert "dtk.bench" in hw.source


def _write(folder, host, rates):
    folder.mkdir(exist_ok=True)
    rows = [{"width": w, "tflops": t} for w, t in rates.items()]
    (folder / f"matmul-{host}.json").write_text(json.dumps({"host": host, "rows": rows}))


def test_the_slowest_node_sets_each_width_and_narrow_slices_compute_slower(tmp_path):
    from test_plan_steptime import job

    from dtk.plan.cost.steptime import step_time
    from dtk.plan.degrees import Degrees
    from dtk.plan.shape import whatif_shape

    _write(tmp_path, "a", {512: 100.0, 1024: 160.0, 4096: 200.0})
    _write(tmp_path, "b", {512: 80.0, 1024: 170.0, 4096: 190.0})
    assert matmul_shares(str(tmp_path)) == ((512, 0.4), (1024, 0.8), (4096, 0.95))
    row = ACCELERATORS["h100-80gb"]
    hw = hardware_of(ClusterConfig(accelerator="h100-80gb", matmul_rates=str(tmp_path)), device="cuda",
                     param_dtype="auto")
    sp = hw.speeds
    assert sp.efficiency_at(256) == pytest.approx(row.efficiency * 0.4)  # below the narrowest: held
    assert sp.efficiency_at(2048) == pytest.approx(row.efficiency * 0.875)  # halfway on log width
    assert sp.efficiency_at(16384) == pytest.approx(row.efficiency * 0.95)
    shape = whatif_shape({"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 4096, "vocab_size": 32000})
    wide = step_time(shape, job(Degrees(1, 1, 8, 1), data_parallel="fsdp"), global_batch=8, tasks_per_node=8, hw=hw)
    narrow = step_time(shape, job(Degrees(1, 1, 1, 8), data_parallel="fsdp"), global_batch=1, tasks_per_node=8,
                       hw=hw)
    # an eighth of the FLOPs per device under tp=8, whose slices of the 4096 wide matmuls are 512 wide
    assert narrow.compute_s / (wide.compute_s / 8) == pytest.approx(0.95 / 0.4)
    plain = hardware_of(ClusterConfig(accelerator="h100-80gb"), device="cuda", param_dtype="auto")
    # without a measurement, the default curve by GEMM width (dtk.plan.accelerators.WIDTH_SHARES)
    assert plain.speeds.efficiency_at(512, 3000) < plain.speeds.efficiency_at(8192, 20000) == row.efficiency


def test_a_file_that_is_not_the_commands_output_is_one_error(tmp_path):
    from dtk.common.errors import UserError

    (tmp_path / "matmul-x.json").write_text("{}")
    with pytest.raises(UserError, match="cluster.matmul_rates="):
        matmul_shares(str(tmp_path))
    with pytest.raises(UserError, match="cluster.matmul_rates="):
        matmul_shares(str(tmp_path / "missing"))
