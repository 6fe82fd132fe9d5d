"""dtk.report holds a run against its plan: the measured step time against the step-time
model's prediction for the job as planned, the measured memory against the prediction the
workers recorded. Run directories written here with a real plan.json (make_plan)."""

from __future__ import annotations

import json

import pytest
from test_report import write_run

from conftest import dtk
from dtk.config.compose import compose
from dtk.plan.plan import make_plan
from dtk.report.numbers import run_numbers
from dtk.report.planned import planned, planned_lines
from dtk.report.runs import load_run

GPU_JOB = ["cluster=slurm", "nodes=2", "cluster.accelerator=h100-80gb", "+scheme=fsdp", "model.dim=2048",
           "model.num_layers=16", "model.num_heads=16", "model.seq_len=1024", "model.vocab_size=32000",
           "train.global_batch=64"]


def run_of(tmp_path, overrides, *, step_time, memory=None):
    path = write_run(tmp_path / "run", {s: 2.0 - s / 100 for s in range(1, 11)}, step_time=step_time)
    plan = make_plan(compose(overrides), cwd=tmp_path)
    (path / "plan.json").write_text(plan.to_json())
    if memory is not None:
        (path / "summary.json").write_text(json.dumps({"status": "finished", "memory": memory}))
    return path


@pytest.mark.slow
def test_gpu_run_step_against_the_plans_prediction(tmp_path):
    proc = dtk("dtk.plan", *GPU_JOB, "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    predicted = json.loads(proc.stdout)["predicted_step_s"]
    assert predicted > 0
    path = run_of(tmp_path, GPU_JOB, step_time=2 * predicted,
                  memory={"predicted_bytes": 40e9, "measured_bytes": 42e9, "basis": "max_memory_allocated",
                          "mismatch_ranks": []})
    run = load_run(path)
    p = planned(run, run_numbers(run))
    assert p["step"]["predicted_s"] == pytest.approx(predicted, rel=1e-3)  # the same model as dtk.plan's
    assert p["step"]["ratio"] == pytest.approx(2.0, rel=1e-2)
    assert p["memory"]["ratio"] == pytest.approx(1.05)
    step, mem = planned_lines(p)
    assert "measured against" in step and "predicted (x2.00)" in step and "h100-80gb" in step
    assert "42.000 GB per device measured against 40.000 GB planned (x1.05, max_memory_allocated)" in mem


def test_cpu_run_says_why_no_step_is_predicted_and_report_prints_it(tmp_path):
    path = run_of(tmp_path, ["tasks_per_node=2"], step_time=0.1,
                  memory={"predicted_bytes": 1.0e8, "measured_bytes": 1.2e8, "basis": "live tensors",
                          "mismatch_ranks": [1]})
    proc = dtk("dtk.report", str(path), "--no-plots", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plan         step time not predicted: no step-time model for this device" in proc.stdout
    assert "0.120 GB per device measured against 0.100 GB planned (x1.20, live tensors); ranks [1] off" in proc.stdout
    out = json.loads(dtk("dtk.report", str(path), "--no-plots", "--json", cwd=tmp_path).stdout)
    assert out["planned"][0]["memory"]["ratio"] == pytest.approx(1.2)
