"""DistributedDataParallel."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, *, device: torch.device, bucket_cap_mb: int, process_group=None) -> nn.Module:
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        process_group=process_group,
        # Parameters are initialised identically on every rank (same seed), and DDP
        # broadcasts rank 0's anyway; gradients as bucket views save one copy per step.
        gradient_as_bucket_view=True,
    )
