"""Device and process group for this worker."""

from __future__ import annotations

import datetime
import os
from typing import Protocol

import torch
import torch.distributed as dist

from dtk.common.errors import UserError
from dtk.config.choices import Backend, DeviceKind


class WorkerRanks(Protocol):
    """Where this worker stands, as dtk.worker.env.WorkerEnv says it (the worker, a later
    stage, hands its env in; dist does not import it)."""

    @property
    def rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def local_world_size(self) -> int: ...
    @property
    def master_addr(self) -> str: ...
    @property
    def master_port(self) -> int: ...


def pick_device(want: DeviceKind, env: WorkerRanks, *, index: int | None = None) -> torch.device:
    """The worker's device. `index`: its CUDA device within the visible set, which its
    placement chose (dtk.worker.placement: its position among the local ranks given the
    same GPUs); None: local rank modulo the visible GPUs (callers without a placement)."""
    if want == DeviceKind.cuda or (want == DeviceKind.auto and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("dist.device=cuda but this worker sees no GPU (CUDA_VISIBLE_DEVICES, the node's driver);"
                            " request GPUs with cluster.gpus_per_node, or use dist.device=cpu")
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count() if index is None else index)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_string(backend: Backend, device_type: str, *, cpu_collectives: bool) -> str:
    """What `init_process_group` is given. On a GPU, NCCL; and when something reduces CPU
    tensors (`cpu_collectives`: FSDP's CPU offload keeps gradients in host memory, so the
    gradient norm and the pipeline's norm reduction run on CPU tensors), gloo beside it for
    CPU tensors - NCCL alone fails on them. Every group made from the default one (the
    DeviceMesh's) inherits both. Without offloading NCCL stays alone: a gloo group on
    every mesh axis costs connections and start-up time for nothing."""
    if backend == Backend.auto:
        backend = Backend.nccl if device_type == "cuda" else Backend.gloo
    if backend == Backend.nccl and cpu_collectives:
        return "cuda:nccl,cpu:gloo"
    return backend.value


def init_process_group(
    env: WorkerRanks, *, backend: Backend, device: torch.device, timeout_s: int, cpu_collectives: bool
) -> None:
    """Join the world with a timeout, so a missing peer fails the start instead of hanging."""
    if env.world_size == 1 and dist.is_initialized():
        return
    os.environ["MASTER_ADDR"] = env.master_addr
    os.environ["MASTER_PORT"] = str(env.master_port)
    dist.init_process_group(
        backend=backend_string(backend, device.type, cpu_collectives=cpu_collectives),
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
