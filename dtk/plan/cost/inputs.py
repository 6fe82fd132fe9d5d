"""What the memory budget reads from a composed config: the model's shape, the device and
its memory, the job's size and scheme. The one place of dtk.plan's budget that reads
config keys.

Device memory, first that applies:
- `cluster.device_memory_gb` (decimal GB per device);
- `cluster.accelerator`, a name in dtk.plan.accelerators;
- on the local cluster with GPUs (a GPU workstation), the memory its smallest visible GPU
  reports (`nvidia-smi`, no torch);
- on the CPU, the node's memory shared by its workers: `cluster.mem_gb` (GiB, the sbatch
  --mem value), else this machine's memory (the local cluster, or a lab whose nodes are
  this machine);
- otherwise unknown: the budget is printed, nothing is judged to fit or not.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtk.config.choices import ClusterKind, DeviceKind
from dtk.config.compose import config_dir
from dtk.config.schema import Config, ModelConfig
from dtk.plan.accelerators import lookup
from dtk.plan.cost.budget import Context
from dtk.plan.cost.exchange import Exchange
from dtk.plan.parts import check_parts
from dtk.plan.plan import Plan
from dtk.plan.shape import ModelShape, builtin_config, builtin_shape, is_builtin, whatif_shape

WHATIF_KEYS = ("params", "layers", "hidden", "seq_len", "heads", "vocab_size")


def plan_keys(cfg: Config) -> dict[str, Any]:
    """The plan.* what-if keys that are set."""
    return {k: v for k, v in dataclasses.asdict(cfg.plan).items() if v is not None}


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver sees


def visible_gpus(cuda_visible_devices: str | None, *, driver_folder: Path = NVIDIA_GPUS) -> int:
    """GPUs this machine shows a process, without torch (the login-node path): the NVIDIA
    driver's GPUs, narrowed by CUDA_VISIBLE_DEVICES as CUDA reads it (the list ends at the
    first entry that is not a device; an empty one hides every GPU)."""
    installed = sum(1 for _ in driver_folder.iterdir()) if driver_folder.is_dir() else 0
    if cuda_visible_devices is None or not installed:
        return installed
    count = 0
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return min(count, installed)


def device_kind(cfg: Config) -> str:
    """`cuda` or `cpu`, without touching torch: what the job asks for, else what the cluster
    declares, else on the local cluster whether this machine shows a GPU (its workers then
    pick CUDA, dist.device=auto)."""
    want = cfg.dist.device
    if want in (DeviceKind.cuda, DeviceKind.cpu):
        return str(want)
    cluster = cfg.cluster
    if cluster.gpus_per_node or cluster.accelerator:
        return "cuda"
    return "cuda" if local_gpus(cfg) else "cpu"


def local_gpus(cfg: Config) -> int:
    """GPUs the local cluster's workers see here; 0 on any other cluster (the login node's
    GPUs, if any, are not the compute nodes')."""
    if cfg.cluster.kind != ClusterKind.local:
        return 0
    return visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), driver_folder=NVIDIA_GPUS)


NVIDIA_SMI_MEMORY = ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"]


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def reported_gpu_memory(cuda_visible_devices: str | None, *, run: Callable[[list[str]], str | None] = _run) -> int | None:
    """Bytes of the smallest GPU this machine shows the workers, as nvidia-smi reports it
    (MiB); None without nvidia-smi. CUDA_VISIBLE_DEVICES narrows it by index."""
    text = run(NVIDIA_SMI_MEMORY)
    if not text:
        return None
    sizes: dict[str, int] = {}
    for line in text.splitlines():
        index, _, mib = (part.strip() for part in line.partition(","))
        if index and mib.isdigit():
            sizes[index] = int(mib) * 2**20
    if cuda_visible_devices is not None:
        wanted = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
        if all(e.isdigit() for e in wanted):
            sizes = {k: v for k, v in sizes.items() if k in wanted}
    return min(sizes.values()) if sizes else None


def device_capacity(cfg: Config, device: str, tasks_per_node: int) -> tuple[int | None, str]:
    """Bytes of memory one worker may use, and where the figure comes from."""
    cluster = cfg.cluster
    device_memory_gb, accelerator = cluster.device_memory_gb, cluster.accelerator
    if device_memory_gb:
        return round(device_memory_gb * 1e9), f"cluster.device_memory_gb={device_memory_gb}"
    if accelerator:
        acc = lookup(accelerator)
        return round(acc.memory_gb * 1e9), f"cluster.accelerator={acc.name} ({acc.memory_gb:g} GB)"
    if device == "cuda" and cfg.cluster.kind == ClusterKind.local:
        reported = reported_gpu_memory(os.environ.get("CUDA_VISIBLE_DEVICES"), run=_run)
        if reported:
            return reported, f"this machine's GPU ({reported / 1e9:.1f} GB, nvidia-smi)"
    if device == "cuda":
        return None, "set cluster.accelerator or cluster.device_memory_gb to check that it fits"
    if cluster.mem_gb:
        node = cluster.mem_gb * 2**30
        return node // tasks_per_node, f"cluster.mem_gb={cluster.mem_gb} GiB per node / {tasks_per_node} workers"
    import psutil

    node = psutil.virtual_memory().total
    return node // tasks_per_node, f"this machine's memory ({node / 1e9:.1f} GB) / {tasks_per_node} workers"


def model_shape(cfg: Config) -> ModelShape:
    whatif = plan_keys(cfg)
    if any(whatif.get(k) is not None for k in WHATIF_KEYS):
        return whatif_shape(whatif)
    transformer = builtin_config(cfg.model)
    if transformer is not None:
        return builtin_shape(transformer)
    from dtk.plan.count_model import count_user_model

    return count_user_model(cfg.model, timeout_s=cfg.plan.count_timeout_s)


def context(cfg: Config, plan: Plan, shape: ModelShape | None = None,
            config_dirs: tuple[Path, ...] = ()) -> Context:
    """The budget's inputs for a planned job; `config_dirs` are the user's config folders
    (dtk.config.compose.SearchPath.config), searched before dtk's own for scheme files."""
    from dtk.config.schema import SchemeConfig

    assert cfg.scheme is not None, "compose() sets the scheme"
    if shape is None:  # the login node: the model's keys are held against its modules first
        shape = model_shape(cfg)
        check_parts(
            shape,
            wrap_classes=shape.wrap_classes if shape.wrap_classes is not None else tuple(cfg.model.wrap_classes),
            tp_plan=shape.tp_plan if shape.tp_plan is not None else dict(cfg.model.tp_plan),
            split_points=tuple(cfg.model.split_points), degrees=plan.degrees,
            pp_virtual_stages=cfg.scheme.pp_virtual_stages, target=f"model._target_={cfg.model._target_}",
        )
    device = device_kind(cfg)
    capacity, source = device_capacity(cfg, device, plan.tasks_per_node)
    whatif = not shape.exact
    model = cfg.model
    return Context(
        shape=shape,
        conf_dirs=(*(str(d) for d in config_dirs), str(config_dir())),
        defaults=dataclasses.asdict(SchemeConfig()),
        chosen=dataclasses.asdict(cfg.scheme),
        nodes=plan.nodes,
        tasks_per_node=plan.tasks_per_node,
        local=plan.cluster_kind == "local",
        global_batch=plan.global_batch,
        micro_batch=cfg.train.micro_batch,
        device=device,
        capacity=capacity,
        capacity_source=source,
        plan_keys=plan_keys(cfg),
        async_checkpoint=cfg.checkpoint.async_save,
        memory_snapshots=cfg.checkpoint.memory_every > 0,
        sync=Exchange.of(cfg.sync),
        # check_scheme reads the built-in transformer's numbers; any other model: none.
        model_checks=model if (is_builtin(model) and not whatif) else ModelConfig(_target_="(not checked)"),
        split_points=tuple(model.split_points) if not whatif else (),
    )
