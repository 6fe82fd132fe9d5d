"""Every plan.* key against its range, in dtk.plan and dtk.submit: one `error:` line that
names the key and the value, exit 2, nothing written; and dtk.submit refuses the keys that
change what its memory check counts (a negative byte count let a job that cannot fit pass)."""

from __future__ import annotations

import math

import pytest

from conftest import run_main

BAD = [  # (override, what the line must say it expects)
    ("plan.params=inf", "positive parameter count"),
    ("plan.params=-7e9", "positive parameter count"),
    ("plan.params=nan", "positive parameter count"),
    ("plan.params=0", "positive parameter count"),
    ("plan.layers=0", "positive count of blocks"),
    ("plan.hidden=-4096", "positive hidden size"),
    ("plan.seq_len=0", "positive sequence length"),
    ("plan.heads=-1", "positive count of attention heads"),
    ("plan.vocab_size=0", "positive vocabulary size"),
    ("plan.param_bytes=-4", "positive byte count per parameter"),
    ("plan.param_bytes=0", "positive byte count per parameter"),
    ("plan.param_bytes=inf", "positive byte count per parameter"),
    ("plan.grad_bytes=-2", "positive byte count per gradient element"),
    ("plan.grad_bytes=nan", "positive byte count per gradient element"),
    ("plan.optimizer_bytes=-12", "0 (an optimizer without state) or more"),
    ("plan.optimizer_bytes=inf", "0 (an optimizer without state) or more"),
    ("plan.max_nodes=0", "node count from 1 to 4096"),
    ("plan.max_nodes=-1", "node count from 1 to 4096"),
    ("plan.max_nodes=5000", "node count from 1 to 4096"),
]
IN_RANGE = {"plan.params": "1", "plan.layers": "1", "plan.hidden": "1", "plan.seq_len": "1", "plan.heads": "1",
            "plan.vocab_size": "1", "plan.param_bytes": "0.5", "plan.grad_bytes": "0.5", "plan.optimizer_bytes": "0",
            "plan.max_nodes": "4096"}
MODEL_KEYS = ("plan.params=", "plan.layers=", "plan.hidden=", "plan.seq_len=", "plan.heads=", "plan.vocab_size=")
SUBMIT_BAD = [b for b in BAD if not b[0].startswith(MODEL_KEYS)]  # the model keys: tests/test_plan_search.py


def _one_error_line(proc, override: str) -> str:
    """The one error line, which names the key and the value given."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("error: ") and "\n" not in line and "Traceback" not in line, proc.stderr
    key, _, given = override.partition("=")
    assert line.startswith(f"error: {key}="), line
    named = line[len(f"error: {key}="):].split(":")[0].split()[0]
    assert float(named) == float(given) or math.isnan(float(named)) and math.isnan(float(given)), line
    return line


@pytest.mark.parametrize("override,want", BAD, ids=[b[0] for b in BAD])
def test_plan_refuses_a_plan_key_out_of_range_with_one_line(tmp_path, override, want):
    # a what-if model around the key, so the budget would compute with it
    whatif = [] if override.startswith("plan.params=") else ["plan.params=7e11"]
    proc = run_main("dtk.plan", *whatif, override, f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    line = _one_error_line(proc, override)
    assert want in line and "leave it unset" in line
    assert not (tmp_path / "runs").exists()
    # the edge of the range plans (a check no tighter than the key's meaning)
    key = override.partition("=")[0]
    proc = run_main("dtk.plan", *whatif, f"{key}={IN_RANGE[key]}", f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0 and "fits" in proc.stdout, proc.stderr


@pytest.mark.parametrize("override,want", SUBMIT_BAD, ids=[b[0] for b in SUBMIT_BAD])
def test_submit_refuses_a_plan_key_out_of_range_with_one_line(tmp_path, override, want):
    proc = run_main("dtk.submit", override, "submit.dry_run=true", f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    _one_error_line(proc, override)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("override", ["plan.param_bytes=2", "plan.grad_bytes=2", "plan.optimizer_bytes=12",
                                      "plan.param_bytes=0.5 plan.optimizer_bytes=0"])
def test_submit_refuses_the_bytes_keys_that_change_what_its_memory_check_counts(tmp_path, override):
    proc = run_main("dtk.submit", *override.split(), "submit.dry_run=true", f"run.root={tmp_path / 'runs'}",
                    cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert line.startswith(f"error: {override}: bytes per element change what the memory check counts")
    assert "\n" not in line and not (tmp_path / "runs").exists()


def test_submit_with_a_negative_byte_count_does_not_pass_the_memory_check_of_a_job_that_cannot_fit(tmp_path):
    # 218M parameters on CPU workers of 2 GiB each: does not fit on one node (tests/test_plan_gate.py)
    job = ["cluster=lab", "tasks_per_node=2", "cluster.mem_gb=4", "+scheme=fsdp", "model.dim=1024",
           "model.num_layers=16", "model.num_heads=16", "model.vocab_size=8000", "model.seq_len=64",
           "train.global_batch=64", "train.micro_batch=1", "submit.dry_run=true", "nodes=1",
           f"run.root={tmp_path / 'runs'}"]
    proc = run_main("dtk.submit", *job, "plan.param_bytes=-400", "plan.optimizer_bytes=-400", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: plan.param_bytes=-400 plan.optimizer_bytes=-400:")
    assert "would submit" not in proc.stdout and not (tmp_path / "runs").exists()


def test_plan_doctor_that_is_no_doctor_folder_is_an_error_on_the_cpu_too(tmp_path):
    proc = run_main("dtk.plan", f"plan.doctor={tmp_path / 'missing'}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: plan.doctor={tmp_path / 'missing'}: not a doctor")


CLUSTER_BAD = ["cluster.device_memory_gb=inf", "cluster.peak_tflops=inf", "cluster.intra_node_gbps=-1",
               "cluster.intra_node_gbps=inf", "cluster.inter_node_gbps=0", "cluster.inter_node_gbps=-400"]


@pytest.mark.parametrize("override", CLUSTER_BAD)
@pytest.mark.parametrize("command", ["dtk.plan", "dtk.submit"])
def test_the_planners_cluster_figures_out_of_range_are_one_error_line(tmp_path, override, command):
    dry = ["submit.dry_run=true"] if command == "dtk.submit" else []
    proc = run_main(command, override, *dry, f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    line = _one_error_line(proc, override)
    assert "expected a positive number, or leave it unset" in line
    assert not (tmp_path / "runs").exists()
