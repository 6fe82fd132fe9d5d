"""The one composition point of parallelism.

Order, fixed: pipeline split → tensor parallel → activation checkpointing → compile →
FSDP / DDP. Each step is an `apply_*` of its own module; this function only decides
which apply and in what order.
"""

from __future__ import annotations

import torch
from torch import nn

from dtk.plan.degrees import Degrees


def parallelize(
    model: nn.Module, *, scheme: dict, degrees: Degrees, device: torch.device
) -> nn.Module:
    """Return the model ready to train on this rank under `scheme`."""
    name = scheme.get("name", "ddp")
    if name != "ddp" or degrees.tp != 1 or degrees.pp != 1 or degrees.dp_shard != 1:
        raise ValueError(
            f"scheme={name} (dp_shard={degrees.dp_shard}, tp={degrees.tp}, pp={degrees.pp}) is not available;"
            " available: ddp"
        )
    model.to(device)
    if degrees.dp_replicate > 1:
        from dtk.parallel.ddp import apply_ddp

        model = apply_ddp(model, device=device, bucket_cap_mb=scheme.get("bucket_cap_mb", 25))
    return model
