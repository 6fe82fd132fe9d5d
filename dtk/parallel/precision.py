"""Mixed precision: which dtype parameters compute in and gradients are reduced in."""

from __future__ import annotations

import torch

from dtk.config.choices import Dtype

DTYPES = {Dtype.float32: torch.float32, Dtype.bfloat16: torch.bfloat16, Dtype.float16: torch.float16}


def resolve_dtype(name: Dtype, device: torch.device, *, auto: torch.dtype) -> torch.dtype:
    """`auto`: the given dtype on a GPU, float32 on the CPU (CPU bf16 matmuls are slow and
    would make the CPU equivalence tests meaningless)."""
    if name == Dtype.auto:
        return auto if device.type == "cuda" else torch.float32
    return DTYPES[name]
