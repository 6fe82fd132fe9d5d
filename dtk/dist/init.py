"""Device and process group for this worker."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from dtk.config.choices import Backend, DeviceKind
from dtk.worker.env import WorkerEnv


def pick_device(want: DeviceKind, env: WorkerEnv) -> torch.device:
    if want == DeviceKind.cuda or (want == DeviceKind.auto and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("dist.device=cuda but no GPU is visible to this process")
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(env: WorkerEnv, *, backend: Backend, device: torch.device, timeout_s: int) -> None:
    """Join the world with a timeout, so a missing peer fails the start instead of hanging."""
    if env.world_size == 1 and dist.is_initialized():
        return
    if backend == Backend.auto:
        backend = Backend.nccl if device.type == "cuda" else Backend.gloo
    os.environ["MASTER_ADDR"] = env.master_addr
    os.environ["MASTER_PORT"] = str(env.master_port)
    dist.init_process_group(
        backend=backend.value,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
