"""What a GPU node needs from the start of a run, checked without one: one worker per GPU
(refused at plan time and at start otherwise), the local cluster's default of one worker
per visible GPU, and the process-group backend string for a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_main
from dtk.config.choices import Backend
from dtk.config.compose import compose
from dtk.dist.init import backend_string, shared_gpu_error
from dtk.errors import UserError
from dtk.plan.inputs import visible_gpus
from dtk.plan.plan import make_plan


@pytest.mark.parametrize(
    ("backend", "device", "cpu_collectives", "want"),
    [
        (Backend.auto, "cuda", False, "nccl"),
        (Backend.auto, "cuda", True, "cuda:nccl,cpu:gloo"),  # FSDP CPU offload: norms of CPU gradients
        (Backend.nccl, "cuda", True, "cuda:nccl,cpu:gloo"),
        (Backend.auto, "cpu", True, "gloo"),
        (Backend.gloo, "cuda", True, "gloo"),  # gloo alone does CPU and (slowly) CUDA tensors
    ],
)
def test_the_backend_string_adds_gloo_beside_nccl_when_something_reduces_on_the_cpu(backend, device, cpu_collectives,
                                                                                     want):
    assert backend_string(backend, device, cpu_collectives=cpu_collectives) == want


def test_more_workers_than_visible_gpus_is_refused_at_start():
    assert shared_gpu_error(8, 8) is None
    assert shared_gpu_error(8, 1) is None  # srun --gpu-bind: each task sees its own GPU
    message = shared_gpu_error(16, 8)
    assert message is not None and message.isascii()
    assert "16 workers" in message and "8 GPUs" in message and "tasks_per_node=8" in message


def test_visible_gpus_reads_the_driver_and_cuda_visible_devices(tmp_path):
    driver = tmp_path / "gpus"
    assert visible_gpus(None, driver_folder=driver) == 0  # no driver: no GPU
    for bus in ("0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"):
        (driver / bus).mkdir(parents=True)
    assert visible_gpus(None, driver_folder=driver) == 4
    assert visible_gpus("1,3", driver_folder=driver) == 2
    assert visible_gpus("", driver_folder=driver) == 0
    assert visible_gpus("0,-1,2", driver_folder=driver) == 1  # CUDA stops at the first invalid entry
    assert visible_gpus("0,1,2,3,4,5", driver_folder=driver) == 4


def plan(*overrides: str, local_gpus: int = 0):
    return make_plan(compose(["train.global_batch=32", *overrides]), local_gpus=local_gpus)


def test_the_plan_refuses_more_workers_per_node_than_gpus():
    with pytest.raises(UserError, match=r"tasks_per_node=16 is more workers than GPUs on a node "
                                        r"\(cluster.gpus_per_node=8\).*use tasks_per_node=8"):
        plan("cluster.kind=slurm", "cluster.gpus_per_node=8", "tasks_per_node=16")
    assert plan("cluster.kind=slurm", "cluster.gpus_per_node=8").tasks_per_node == 8
    # Workers on the CPU of a GPU node share nothing.
    assert plan("cluster.kind=slurm", "cluster.gpus_per_node=8", "tasks_per_node=16",
                "dist.device=cpu").tasks_per_node == 16


def test_the_local_cluster_starts_one_worker_per_visible_gpu():
    assert plan(local_gpus=4).tasks_per_node == 4
    assert plan(local_gpus=0).tasks_per_node == 2  # a CPU machine: the CPU default
    assert plan("dist.device=cpu", local_gpus=4).tasks_per_node == 2
    with pytest.raises(UserError, match=r"tasks_per_node=4 .* \(this machine shows 2 GPUs\)"):
        plan("tasks_per_node=4", local_gpus=2)


def test_the_refusal_is_one_error_line(tmp_path: Path):
    proc = run_main("dtk.plan", "cluster.kind=slurm", "cluster.gpus_per_node=4", "tasks_per_node=8", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tasks_per_node=8 is more workers than GPUs"), proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written
