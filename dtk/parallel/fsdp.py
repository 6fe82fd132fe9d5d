"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over dp_shard,
replicated over dp_replicate (HSDP) when that axis is larger than 1."""

from __future__ import annotations

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
    forward and in backward), then the rest of the model as the root unit."""
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
