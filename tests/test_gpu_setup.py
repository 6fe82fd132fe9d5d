"""What a GPU node needs from the start of a run, checked without one: one worker per GPU
(refused at plan time; at start, tests/test_placement.py), the local cluster's default of one worker
per visible GPU, and the process-group backend string for a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_main
from dtk.common.errors import UserError
from dtk.config.choices import Backend
from dtk.config.compose import compose
from dtk.mesh.init import backend_string
from dtk.plan.cost.inputs import visible_gpus
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


NVIDIA_SMI = Path(__file__).parent / "fixtures" / "gpu_box" / (
    "nvidia-smi_--query-gpu=index,memory.total_--format=csv,noheader,nounits.txt")


def test_the_reported_gpu_memory_is_the_smallest_visible_gpus():
    from dtk.plan.cost.inputs import NVIDIA_SMI_MEMORY, reported_gpu_memory

    def recorded(argv):
        assert argv == NVIDIA_SMI_MEMORY
        return NVIDIA_SMI.read_text().replace("7, 81559", "7, 40960")  # one smaller GPU

    assert reported_gpu_memory(None, run=recorded) == 40960 * 2**20
    assert reported_gpu_memory("0,3", run=recorded) == 81559 * 2**20
    assert reported_gpu_memory(None, run=lambda argv: None) is None  # no nvidia-smi


def test_a_local_gpu_box_is_budgeted_with_its_gpus_memory(tmp_path, monkeypatch):
    """8 x 80 GB GPUs on the local cluster: the budget the submit gate and dtk.plan use is
    CUDA with each GPU's memory, as the workers' own prediction is, not host RAM / workers."""
    from dtk.plan.cost import inputs
    from dtk.plan.cost.report import memory_plan

    driver = tmp_path / "gpus"
    for k in range(8):
        (driver / f"0000:{k + 0x10:02x}:00.0").mkdir(parents=True)
    monkeypatch.setattr(inputs, "NVIDIA_GPUS", driver)
    monkeypatch.setattr(inputs, "_run", lambda argv: NVIDIA_SMI.read_text() if argv == inputs.NVIDIA_SMI_MEMORY else None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = compose(["train.global_batch=32"])
    planned = make_plan(cfg, local_gpus=8)
    ctx = inputs.context(cfg, planned)
    assert (ctx.device, ctx.capacity) == ("cuda", 81559 * 2**20)
    assert "nvidia-smi" in ctx.capacity_source
    budget = memory_plan(ctx, planned).to_json()
    assert budget["device"]["kind"] == "cuda" and budget["device"]["memory_bytes"] == 81559 * 2**20
    # The same box asked for the CPU is budgeted as before: host memory over its workers.
    cpu = compose(["train.global_batch=32", "dist.device=cpu"])
    assert inputs.context(cpu, make_plan(cpu, local_gpus=8)).device == "cpu"
