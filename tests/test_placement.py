"""Each rank's GPU and CPUs (dtk.worker.placement), on recorded nodes: the GPU at the rank's
position among the tasks that Slurm gave the same GPUs, the CPUs of that GPU's NUMA node
within the task's allotment, and a refusal that names the binding when two ranks are left
one GPU."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from dtk.common.errors import UserError
from dtk.topology.parse import cpulist
from dtk.topology.source import RecordedSource
from dtk.worker.placement import binding_name, choose_gpu, driver_gpus, nvml_gpus, place, share_visible

FIXTURES = Path(__file__).parent / "fixtures" / "placement"
DGX = RecordedSource(FIXTURES / "dgx")
ONE_SOCKET = RecordedSource(FIXTURES / "one-socket")
SOCKET0 = set(cpulist("0-55,112-167"))
SOCKET1 = set(cpulist("56-111,168-223"))
ALL_DGX = SOCKET0 | SOCKET1
BINDING = binding_name(["--gpu-bind=closest"], gpu_bind="closest", slurm=True)


def node_ranks(visible: dict[int, str | None], src, *, allotted=lambda _r: ALL_DGX, num_gpus=8):
    return [place(rank=r, node="dgx-001", local_rank=r, visible=visible, num_gpus=num_gpus, binding=BINDING,
                  allotted=allotted(r), src=src, cvd=visible[r]) for r in sorted(visible)]


def test_one_gpu_per_task_gives_each_rank_its_gpu_and_its_numa_node():
    placements = node_ranks({r: str(r) for r in range(8)}, DGX)  # srun --gpus-per-task=1
    assert [p.gpu for p in placements] == list(range(8))
    assert [p.device_index for p in placements] == [0] * 8
    assert [p.numa for p in placements] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(set(p.cpus) == SOCKET0 for p in placements[:4])
    assert all(set(p.cpus) == SOCKET1 for p in placements[4:])


def test_closest_shows_each_task_its_socket_and_the_ranks_split_it_by_position():
    # --gpu-bind=closest on a DGX: every task sees the 4 GPUs of its socket.
    visible = {r: "0,1,2,3" if r < 4 else "4,5,6,7" for r in range(8)}
    placements = node_ranks(visible, DGX)
    assert [p.gpu for p in placements] == list(range(8))
    assert [p.device_index for p in placements] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [p.numa for p in placements] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [p.cuda_visible_devices for p in placements] == [visible[r] for r in range(8)]


def test_all_gpus_visible_is_local_rank_order():
    placements = node_ranks({r: None for r in range(8)}, DGX)  # no binding, CVD unset
    assert [p.gpu for p in placements] == list(range(8))
    assert [p.device_index for p in placements] == list(range(8))


def test_the_cpus_are_those_slurm_allotted_on_the_gpus_node():
    allotted = set(range(0, 8)) | set(range(56, 64))  # a task given cores of both sockets
    placements = node_ranks({r: str(r) for r in range(8)}, DGX, allotted=lambda _r: allotted)
    assert placements[0].cpus == list(range(0, 8))
    assert placements[7].cpus == list(range(56, 64))
    # None of the node's CPUs allotted: the task keeps what it was given rather than nothing.
    only_socket0 = node_ranks({5: "5"}, DGX, allotted=lambda _r: set(range(4)))
    assert only_socket0[0].numa == 1 and only_socket0[0].cpus == [0, 1, 2, 3]


def test_one_socket_gives_every_rank_the_one_node():
    allotted = set(range(32))
    placements = node_ranks({r: str(r) for r in range(4)}, ONE_SOCKET, allotted=lambda _r: allotted, num_gpus=4)
    assert [p.numa for p in placements] == [0, 0, 0, 0]
    assert all(p.cpus == list(range(32)) for p in placements)


def test_a_node_without_numa_information_keeps_the_allotment(tmp_path):
    (tmp_path / "fs").mkdir()  # no driver folder, no sysfs: the CPU lab
    placements = node_ranks({0: "0", 1: "1"}, RecordedSource(tmp_path), allotted=lambda _r: {0, 1}, num_gpus=0)
    assert [(p.gpu, p.numa, p.cpus) for p in placements] == [(0, None, [0, 1]), (1, None, [0, 1])]


class RecordedNvml:
    """NVML's answers as recorded on the DGX-like node (fixtures/placement/nvml-dgx.json)."""

    def __init__(self, path: Path) -> None:
        self.devices = json.loads(path.read_text())
        self.open = False

    def nvmlInit(self):
        self.open = True

    def nvmlShutdown(self):
        self.open = False

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, k):
        assert self.open
        return self.devices[k]

    def nvmlDeviceGetPciInfo(self, handle):
        return type("PciInfo", (), {"busId": handle["bus_id"].encode()})()

    def nvmlDeviceGetMinorNumber(self, handle):
        return handle["minor"]


def test_nvml_names_the_same_buses_as_the_driver_folder(tmp_path):
    nvml = RecordedNvml(FIXTURES / "nvml-dgx.json")
    assert nvml_gpus(nvml) == driver_gpus(DGX)
    assert not nvml.open
    # A node whose driver folder is hidden: the bus ids come from NVML, the NUMA node from sysfs.
    sysfs_only = tmp_path / "dgx-no-proc"
    (sysfs_only / "fs").mkdir(parents=True)
    os.symlink((FIXTURES / "dgx" / "fs" / "sys").resolve(), sysfs_only / "fs" / "sys")
    src = RecordedSource(sysfs_only)
    assert driver_gpus(src) == {}
    placement = place(rank=6, node="dgx-001", local_rank=0, visible={0: "6"}, num_gpus=8, binding=BINDING,
                      allotted=ALL_DGX, src=src, cvd="6", nvml=nvml)
    assert placement.numa == 1 and set(placement.cpus) == SOCKET1


def test_slurms_node_wide_ids_tell_tasks_apart_where_device_cgroups_renumber_them():
    # ConstrainDevices=yes: every task's CVD counts from 0; SLURM_STEP_GPUS holds the ids.
    step_gpus = {r: str(r) for r in range(8)}
    placements = [place(rank=r, node="dgx-001", local_rank=r, visible=step_gpus, num_gpus=8, binding=BINDING,
                        allotted=ALL_DGX, src=DGX, cvd="0", named_by="SLURM_STEP_GPUS") for r in range(8)]
    assert [p.gpu for p in placements] == list(range(8))
    assert [(p.cuda_visible_devices, p.device_index) for p in placements] == [("0", 0)] * 8
    assert [p.numa for p in placements] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(UserError, match=r"\(SLURM_STEP_GPUS=0\)"):
        choose_gpu(1, {0: "0", 1: "0"}, num_gpus=8, node="n", binding=BINDING, named_by="SLURM_STEP_GPUS")


def test_two_ranks_left_one_gpu_are_refused_with_the_binding_named():
    # A site's map_gpu binding that gives local ranks 0 and 4 the same GPU.
    visible = {r: str(r % 4) for r in range(8)}
    binding = binding_name(["--gpu-bind=map_gpu:0,1,2,3,0,1,2,3"], gpu_bind="map_gpu:0,1,2,3,0,1,2,3", slurm=True)
    with pytest.raises(UserError) as caught:
        choose_gpu(4, visible, num_gpus=8, node="node1", binding=binding)
    message = str(caught.value)
    assert message.startswith("srun --gpu-bind=map_gpu:0,1,2,3,0,1,2,3 (cluster.gpu_bind=map_gpu:0,1,2,3,0,1,2,3)")
    assert "local ranks 0, 4 of node1" in message and "CUDA_VISIBLE_DEVICES=0" in message
    assert "tasks_per_node" not in message and message.isascii()
    assert choose_gpu(0, visible, num_gpus=8, node="node1", binding=binding) == (0, "0")  # the first keeps it


def test_no_gpu_is_chosen_where_none_is_visible():
    assert choose_gpu(0, {0: "", 1: ""}, num_gpus=8, node="n", binding=BINDING) is None
    assert choose_gpu(0, {0: None}, num_gpus=0, node="n", binding=BINDING) is None


def test_local_ranks_meet_in_a_folder(tmp_path):
    got: dict[int, dict] = {}

    def rank(r: int) -> None:
        got[r] = share_visible(tmp_path, node_rank=1, local_rank=r, local_world_size=4,
                               cvd=None if r == 3 else f"{r // 2}", timeout_s=30)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(v == {0: "0", 1: "0", 2: "1", 3: None} for v in got.values())
    with pytest.raises(RuntimeError, match=r"local rank\(s\) 1 of node 0 did not say their GPUs"):
        share_visible(tmp_path / "alone", node_rank=0, local_rank=0, local_world_size=2, cvd="0", timeout_s=0)
