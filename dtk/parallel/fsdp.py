"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over dp_shard,
replicated over dp_replicate (HSDP) when that axis is larger than 1."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from dtk.parallel.units import wrap_units


def apply_fsdp(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    wrap_classes: tuple[str, ...],
    reshard_after_forward: bool,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool,
    device: torch.device,
) -> nn.Module:
    """Shard each block of `wrap_classes` as its own unit (one all-gather per block in
    forward and in backward), then the rest of the model as the root unit.
    `reshard_after_forward` is the planner's answer for the job
    (dtk.plan.layout.reshards_after_forward: false under a pipeline unless set); torch's
    pipeline stage leaves the units gathered through a step's backwards and reshards and
    reduce-scatters them once, at the step's end (PipelineStage.perform_reduce_grad)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    blocks = wrap_units(module, wrap_classes)
    for i, (_, block) in enumerate(blocks):
        # The last block's parameters would be gathered again at once for backward;
        # keeping them saves one all-gather per step.
        last = i == len(blocks) - 1
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward and not last,
            mp_policy=mp,
            offload_policy=offload,
        )
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    return module


def materialize_offloaded(parts: list[nn.Module], materialize: Callable[[list[nn.Module], torch.device], None], *,
                          device: torch.device) -> None:
    """Storage for parts sharded with CPU offload: the parameter shards in host memory,
    where FSDP keeps them (it refuses shards made on the device: "FSDP parameters should be
    materialized on CPU"), and the buffers on `device`, where the forward reads them and
    FSDP does not move them. torchtitan does the same with its init and buffer devices."""
    materialize(parts, torch.device("cpu"))
    for part in parts:
        for module in part.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)
