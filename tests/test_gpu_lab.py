"""On the GPU-shaped lab (2 nodes, Gres=gpu:8 on two sockets): a 2 x 8 job with the default
binding trains to the end and every node's 8 ranks use GPUs 0-7 once each, each given its
own GPU by Slurm (srun --gpus-per-task=1); a site binding that leaves two ranks one GPU is
refused at start with a line naming the binding. Workers train on the CPU and record the
GPU they would use. The lab this module changes is restored afterwards."""

from __future__ import annotations

import json

import pytest

from conftest import dtk, only_run_dir
from dtk import lab
from lab_support import ensure_lab, lab_down, unavailable_reason

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

# 16 gloo ranks on a 2-core machine: a tiny model and two steps.
JOB = ["cluster=lab", "nodes=2", "tasks_per_node=8", "cluster.gpus_per_node=8", "dist.device=cpu",
       "model.dim=16", "model.num_heads=2", "model.num_layers=1", "model.seq_len=8", "train.steps=2",
       "train.global_batch=16", "train.log_every=1", "train.system_every_s=0", "fault.max_restarts=0",
       "submit.wait=true"]


@pytest.fixture(scope="module")
def gpu_lab():
    reason = unavailable_reason()
    before = lab.status() if reason is None else None
    yield ensure_lab(2, gpus_per_node=8)
    if before is not None and before.up:
        ensure_lab(before.num_nodes, gpus_per_node=before.record.num_gpus)
    else:
        lab_down()


def test_two_nodes_of_eight_gpus_train_with_each_rank_on_its_own_gpu(gpu_lab, tmp_path):
    proc = dtk("dtk.submit", *JOB, f"run.root={tmp_path / 'runs'}", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = only_run_dir(tmp_path / "runs")
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
    placement = json.loads((run / "topology.json").read_text())["placement"]
    assert [p["rank"] for p in placement] == list(range(16))
    for node in ("node1", "node2"):
        ranks = [p for p in placement if p["node"] == node]
        assert sorted(p["local_rank"] for p in ranks) == list(range(8))
        assert sorted(p["gpu"] for p in ranks) == list(range(8)), ranks
        # Slurm's own binding: each task was shown one GPU, the one it uses.
        assert all(p["cuda_visible_devices"] == str(p["gpu"]) and p["device_index"] == 0 for p in ranks), ranks
        assert all(p["cpus"] for p in ranks)


def test_a_binding_that_leaves_two_ranks_one_gpu_is_refused_naming_it(gpu_lab, tmp_path):
    binding = "map_gpu:0,1,2,3,0,1,2,3"
    proc = dtk("dtk.submit", *[a for a in JOB if not a.startswith("nodes=")], "nodes=1", f"cluster.gpu_bind='{binding}'",
               f"run.root={tmp_path / 'runs'}", cwd=tmp_path, timeout=900)
    assert proc.returncode != 0, proc.stdout[-3000:]
    run = only_run_dir(tmp_path / "runs")
    error = json.loads((run / "summary.json").read_text())["error"]
    assert f"srun --gpu-bind={binding} (cluster.gpu_bind={binding}) gave local ranks" in error, error
    assert "tasks_per_node" not in error
