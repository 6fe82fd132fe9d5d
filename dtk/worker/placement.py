"""Where this worker runs on its node: its GPU, and the CPUs of that GPU's NUMA node.

GPU. Slurm gives each task a CUDA_VISIBLE_DEVICES (CVD): one GPU under `--gpus-per-task=1`
or `--gpu-bind=single:1`, the GPUs of its socket under `--gpu-bind=closest`, all of them
without a binding. Whatever the site's binding, a worker takes the GPU at its position
among the tasks of its node that were given the same visible set: the local ranks meet in
the run directory (`logs/start_NN/gpus/`) and compare their sets. Two tasks left with one
GPU cannot both use it (NCCL refuses a shared GPU): that is refused with a line naming the
binding. A worker on the CPU (`dist.device=cpu`, the GPU-shaped lab) records the GPU it
would use.

CPUs. The worker binds itself (os.sched_setaffinity, which threads started later inherit)
to the CPUs of its GPU's NUMA node, intersected with the CPUs Slurm allotted the task, as
torchrun's --numa-binding does. The GPU's NUMA node is read from sysfs: the NVIDIA driver's
/proc/driver/nvidia/gpus/BUS/information gives each GPU's device minor (the N of
/dev/nvidiaN, which gres.conf names), /sys/bus/pci/devices/BUS/numa_node its NUMA node;
NVML (the nvidia-ml-py package) gives the minor and bus id where the driver's folder is
absent. No torch here.

Under Slurm the ranks compare SLURM_STEP_GPUS (each task's GPU ids on the node, in CVD's
order) rather than CVD, which device cgroups (ConstrainDevices=yes) renumber from 0 per
task; `gpu` is then that id. Without Slurm it is CVD's entry.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.topology.parse import cpulist
from dtk.topology.source import LiveSource, Source

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
PCI_DEVICES = "/sys/bus/pci/devices"
NUMA_NODES = "/sys/devices/system/node"
POLL_S = 0.1


@dataclass(frozen=True)
class Placement:
    """One rank's place, as topology.json's `placement` records it."""

    rank: int
    node: str
    local_rank: int
    cuda_visible_devices: str | None
    """What Slurm (or the launcher) gave this task; None: unset (every GPU visible)."""
    device_index: int | None
    """The CUDA device this worker uses, counted within its visible set; None: no GPU."""
    gpu: int | str | None
    """The physical GPU (CVD's entry: an index, or a UUID); on the CPU, the one it would use."""
    numa: int | None
    """The GPU's NUMA node; None: unknown (no GPU, or a machine with one node)."""
    cpus: list[int]
    """The CPUs this worker runs on."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def visible_entries(cvd: str | None, num_gpus: int) -> list[str]:
    """The devices a CVD names, as CUDA reads it (the list ends at the first entry that is
    not a device); unset: every GPU of the node."""
    if cvd is None:
        return [str(k) for k in range(num_gpus)]
    entries = []
    for entry in cvd.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return entries


def choose_gpu(local_rank: int, visible: dict[int, str | None], *, num_gpus: int, node: str,
               binding: str, named_by: str = "CUDA_VISIBLE_DEVICES") -> tuple[int, str] | None:
    """(index within this rank's visible set, the entry of that GPU), or None without GPUs.
    `visible`: every local rank's GPU list, as the variable `named_by` gives it. The rank
    takes the GPU at its position among the local ranks given the same list; `binding`
    names how Slurm bound them, for the refusal."""
    mine = visible[local_rank]
    entries = visible_entries(mine, num_gpus)
    if not entries:
        return None
    sharers = sorted(r for r, cvd in visible.items() if cvd == mine)
    position = sharers.index(local_rank)
    if position >= len(entries):
        shown = "unset" if mine is None else mine
        raise UserError(
            f"{binding} gave local ranks {', '.join(map(str, sharers))} of {node} the same"
            f" {len(entries)} GPU(s) ({named_by}={shown}): two workers would share a GPU, which NCCL"
            " refuses; use a binding that gives each task its own GPU (cluster.gpu_bind=null: srun"
            " --gpus-per-task=1) or fewer tasks per node")
    return position, entries[position]


def binding_name(step_flags: list[str], *, gpu_bind: str | None, slurm: bool) -> str:
    """How the worker step bound GPUs, for the refusal: the srun flags and the key behind them."""
    if not slurm:
        return "the local driver (every worker sees this machine's GPUs)"
    if gpu_bind:
        return f"srun {' '.join(step_flags)} (cluster.gpu_bind={gpu_bind})"
    return f"srun {' '.join(step_flags)}" if step_flags else "srun without a GPU binding (cluster.gpu_bind=null)"


def share_visible(folder: Path, *, node_rank: int, local_rank: int, local_world_size: int, cvd: str | None,
                  timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> dict[int, str | None]:
    """Every local rank's CVD: each writes its own file, then reads its node's. The run
    directory is where ranks meet before any process group exists (dtk.topology.start)."""
    if local_world_size == 1:
        return {local_rank: cvd}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"node_{node_rank:02d}.rank_{local_rank:03d}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"cuda_visible_devices": cvd}))
    os.replace(tmp, path)
    deadline = time.monotonic() + timeout_s
    while True:
        files = {r: folder / f"node_{node_rank:02d}.rank_{r:03d}.json" for r in range(local_world_size)}
        missing = [r for r, f in files.items() if not f.exists()]
        if not missing:
            return {r: json.loads(f.read_text())["cuda_visible_devices"] for r, f in files.items()}
        if time.monotonic() > deadline:
            raise RuntimeError(f"local rank(s) {', '.join(map(str, missing))} of node {node_rank} did not say their"
                               f" GPUs in {folder} within {timeout_s:g} s")
        sleep(POLL_S)


def driver_gpus(src: Source) -> dict[int, str]:
    """Device minor -> PCI bus id of every GPU the NVIDIA driver shows (its /proc folder)."""
    out: dict[int, str] = {}
    for bus in src.listdir(NVIDIA_GPUS):
        text = src.read(f"{NVIDIA_GPUS}/{bus}/information") or ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Device Minor" and value.strip().isdigit():
                out[int(value)] = bus.lower()
    return out


def nvml_gpus(nvml: Any) -> dict[int, str]:
    """Device minor -> PCI bus id from NVML (the `pynvml` module of nvidia-ml-py)."""
    nvml.nvmlInit()
    try:
        out = {}
        for k in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(k)
            bus = nvml.nvmlDeviceGetPciInfo(handle).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            out[int(nvml.nvmlDeviceGetMinorNumber(handle))] = bus.lower()[-12:]  # 00000000:1B:00.0 -> 0000:1b:00.0
        return out
    finally:
        nvml.nvmlShutdown()


def load_nvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def gpu_numa(gpu: int | str | None, src: Source, nvml: Any | None = None) -> int | None:
    """The NUMA node of physical GPU `gpu` (an index, as /dev/nvidiaN numbers it)."""
    if not isinstance(gpu, int):
        return None
    buses = driver_gpus(src)
    if not buses and nvml is not None:
        try:
            buses = nvml_gpus(nvml)
        except Exception:  # NVML present but no driver answering: the NUMA node stays unknown
            buses = {}
    bus = buses.get(gpu)
    text = src.read(f"{PCI_DEVICES}/{bus}/numa_node") if bus else None
    if text is None or not text.strip().lstrip("-").isdigit():
        return None
    numa = int(text)
    return numa if numa >= 0 else None  # -1: the kernel knows of one node only


def numa_cpus(numa: int | None, allotted: set[int], src: Source) -> list[int]:
    """The allotted CPUs on NUMA node `numa`; all allotted ones where that leaves none."""
    if numa is None:
        return sorted(allotted)
    node = set(cpulist(src.read(f"{NUMA_NODES}/node{numa}/cpulist") or ""))
    return sorted(allotted & node) or sorted(allotted)


def place(*, rank: int, node: str, local_rank: int, visible: dict[int, str | None], num_gpus: int, binding: str,
          allotted: set[int], src: Source, cvd: str | None, nvml: Any | None = None, wants_gpu: bool = True,
          named_by: str = "CUDA_VISIBLE_DEVICES") -> Placement:
    """This rank's GPU and CPUs (pure given its inputs: the caller binds). `visible`: each
    local rank's GPU ids (`named_by`: SLURM_STEP_GPUS under Slurm, else CVD); `cvd`: this
    rank's CVD, for the record. Without `wants_gpu` (a CPU job) no GPU
    is chosen and the CPUs stay those allotted."""
    chosen = choose_gpu(local_rank, visible, num_gpus=num_gpus, node=node, binding=binding,
                        named_by=named_by) if wants_gpu else None
    index, entry = chosen if chosen else (None, None)
    gpu: int | str | None = int(entry) if entry is not None and entry.isdigit() else entry
    numa = gpu_numa(gpu, src, nvml)
    return Placement(rank=rank, node=node, local_rank=local_rank, cuda_visible_devices=cvd,
                     device_index=index, gpu=gpu, numa=numa, cpus=numa_cpus(numa, allotted, src))


def place_this_worker(*, rank: int, node: str, node_rank: int, local_rank: int, local_world_size: int,
                      meet: Path, timeout_s: float, binding: str, wants_gpu: bool) -> Placement:
    """Meet the node's other ranks, choose, and bind this process to the chosen CPUs.
    `wants_gpu`: the worker uses a GPU, or would on a GPU node (the CPU lab)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    # Slurm names each task's GPUs by their ids on the node in SLURM_STEP_GPUS (in CVD's
    # order); CVD may count from 0 per task where device cgroups confine it, so two tasks
    # showing "0" need not share a GPU. Without Slurm, CVD is all there is.
    step_gpus = os.environ.get("SLURM_STEP_GPUS")
    ids, named_by = (step_gpus, "SLURM_STEP_GPUS") if step_gpus is not None else (cvd, "CUDA_VISIBLE_DEVICES")
    src = LiveSource()
    num_gpus = len(driver_gpus(src))
    visible = share_visible(meet, node_rank=node_rank, local_rank=local_rank, local_world_size=local_world_size,
                            cvd=ids, timeout_s=timeout_s) if wants_gpu else {local_rank: ids}
    allotted = set(os.sched_getaffinity(0))
    placement = place(rank=rank, node=node, local_rank=local_rank, visible=visible, num_gpus=num_gpus,
                      binding=binding, allotted=allotted, src=src, nvml=load_nvml() if wants_gpu else None,
                      wants_gpu=wants_gpu, cvd=cvd, named_by=named_by)
    if set(placement.cpus) != allotted:
        os.sched_setaffinity(0, placement.cpus)
    return placement
