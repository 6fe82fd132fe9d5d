"""dtk.submit plans the memory first: a job that cannot fit is refused before the queue with
the numbers and the smallest node count that fits; with that count it goes; submit.force
submits anyway; a sweep skips the points that cannot fit. Dry runs on the lab cluster's
config (nothing is started, no Slurm is asked)."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from conftest import REPO, run_main

# 218M parameters on CPU workers with 2 GiB each (cluster.mem_gb=4 over 2 workers): FSDP
# over one node does not fit, over a few it does.
JOB = ["cluster=lab", "tasks_per_node=2", "cluster.mem_gb=4", "+scheme=fsdp", "model.dim=1024", "model.num_layers=16",
       "model.num_heads=16", "model.vocab_size=8000", "model.seq_len=64", "train.global_batch=64",
       "train.micro_batch=1", "submit.dry_run=true"]


def test_submit_refuses_a_job_that_cannot_fit_and_names_the_node_count_that_does(tmp_path):
    root = f"run.root={tmp_path / 'runs'}"
    proc = run_main("dtk.submit", *JOB, "nodes=1", root, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("error: the job does not fit: ") and "\n" not in line and "Traceback" not in line
    assert "GB per device under fsdp on 1 node(s)" in line and "> 2.15 GB (cluster.mem_gb=4" in line
    nodes = int(re.search(r"nodes=(\d+) with this scheme \(fsdp\)", line).group(1))
    assert nodes > 1
    assert not (tmp_path / "runs").exists()

    proc = run_main("dtk.submit", *JOB, f"nodes={nodes}", root, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"slurm: {nodes} node(s) x 2 worker(s)" in proc.stdout
    # the count named is the smallest: every smaller count that can run this job is refused
    for smaller in (n for n in range(2, nodes) if 64 % (2 * n) == 0):
        proc = run_main("dtk.submit", *JOB, f"nodes={smaller}", root, cwd=tmp_path)
        assert proc.returncode == 2 and "does not fit" in proc.stderr, smaller

    forced = run_main("dtk.submit", *JOB, "nodes=1", "submit.force=true", root, cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert "note: submit.force=true: submitting although the job does not fit" in forced.stderr


def test_sweep_skips_the_points_that_cannot_fit(tmp_path):
    proc = run_main("dtk.submit", "-m", *JOB, "nodes=1,2,4", f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    skipped = [ln for ln in proc.stdout.splitlines() if ln.startswith("skipped: ")]
    assert [re.search(r" nodes=(\d+)", ln.split(": the job")[0]).group(1) for ln in skipped] == ["1", "2"]
    assert all("does not fit" in ln for ln in skipped)
    submitted = [ln for ln in proc.stdout.splitlines() if ln.startswith("=== ")]
    assert len(submitted) == 1 and " nodes=4" in submitted[0]


# Rajbhandari et al. 2020, Figure 1: GB per device of model states, 7.5B parameters on 64 devices.
ZERO_PAPER_GB = {"ddp": 120.0, "zero": 31.4, "zero2": 16.6, "fsdp": 1.9}


def test_zero_paper_command_in_docs(tmp_path):
    lines = [ln.strip() for ln in (REPO / "docs" / "planning.md").read_text().splitlines()]
    command = next(ln for ln in lines if ln.startswith("python -m dtk.plan") and "plan.params=7.5e9" in ln)
    proc = run_main(*shlex.split(command)[2:], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    schemes = json.loads(proc.stdout)["schemes"]
    for key, paper in ZERO_PAPER_GB.items():
        got = schemes[key]["model_states_bytes"] / 1e9
        assert abs(got - paper) <= 0.02 * paper, (key, got, paper)


USER_MODEL_YAML = """\
_target_: tests.models_for_tests.build
vocab_size: 256
seq_len: 32
width: 32
depth: 4
expansion: 2
wrap_classes: [ResidualMLP]
"""


@pytest.mark.slow  # counts the user model on the meta device: a torch import in a subprocess
def test_a_user_model_is_counted_on_the_meta_device_in_a_subprocess_with_a_time_limit(tmp_path):
    from dtk.config.convert import model_config
    from dtk.plan.count_model import NotCounted, count_user_model
    from tests.models_for_tests import build

    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mlp_lm.yaml").write_text(USER_MODEL_YAML)
    proc = run_main("dtk.plan", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "model=mlp_lm", "+scheme=fsdp",
                    "tasks_per_node=2", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    real = build(vocab_size=256, seq_len=32, width=32, depth=4, expansion=2)
    assert out["params"] == sum(p.numel() for p in real.parameters())
    assert "counted on the meta device" in out["model"]
    # fsdp over 2 ranks: each holds about half of the fp32 parameters
    assert abs(out["per_device_bytes"]["params"] - 4 * out["params"] / 2) <= 0.05 * 4 * out["params"]
    model = model_config({"_target_": "tests.models_for_tests.build", "vocab_size": 256, "seq_len": 32, "width": 32,
                          "depth": 4, "expansion": 2})
    with pytest.raises(NotCounted, match="took over"):
        count_user_model(model, timeout_s=0.01)  # the login path never waits longer than its limit


@pytest.mark.slow  # counts the user model on the meta device: a torch import in a subprocess
def test_plan_md_of_a_user_model_whose_split_points_fix_the_pipeline_stages(tmp_path):
    from dtk.submit.__main__ import plan_points

    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mlp_lm.yaml").write_text(USER_MODEL_YAML + "split_points: [blocks.2]\n")
    [point] = plan_points([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "model=mlp_lm", "+scheme=pp",
                           "tasks_per_node=2", "train.global_batch=16", "train.micro_batch=4",
                           f"run.root={tmp_path / 'runs'}"], multirun=False)
    text = point.files()["plan.md"]
    rows = [ln for ln in text.split("## Expanding")[1].splitlines() if ln.startswith("| 2 ")]
    # Two split points' worth of stages stay two stages on more nodes: the layout is replicated.
    assert rows and "dp_replicate=2 pp=2" in rows[0], text
