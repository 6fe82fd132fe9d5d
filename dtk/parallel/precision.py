"""Mixed precision: which dtype parameters compute in and gradients are reduced in, how
float32 matmuls run, and the autocast that training and evaluation share."""

from __future__ import annotations

import contextlib

import torch

from dtk.common.errors import UserError
from dtk.config.choices import Dtype, MatmulPrecision

DTYPES = {Dtype.float32: torch.float32, Dtype.bfloat16: torch.bfloat16, Dtype.float16: torch.float16}

# torch.set_float32_matmul_precision's names; `auto` is resolved per device (matmul_precision).
MATMUL = {MatmulPrecision.highest: "highest", MatmulPrecision.high: "high", MatmulPrecision.medium: "medium"}


def bf16_supported(device: torch.device) -> bool:
    """Whether the device computes in bfloat16 natively (CUDA: Ampere or newer; emulation on
    older GPUs is slower than float32 and does not count)."""
    if device.type != "cuda":
        return True
    return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_dtype(name: Dtype, device: torch.device, *, auto: torch.dtype, key: str,
                  bf16: bool | None = None) -> torch.dtype:
    """The dtype of `key` (scheme.param_dtype, scheme.reduce_dtype). `auto`: the given dtype on a
    GPU - bfloat16 only where the GPU supports it, else float32 - and float32 on the CPU (CPU
    bf16 matmuls are slow and would make the CPU equivalence tests meaningless). float16 is
    refused by the plan (dtk has no gradient scaler). `bf16`: the device's support, when known."""
    supported = bf16_supported(device) if bf16 is None else bf16
    if name == Dtype.auto:
        if device.type != "cuda":
            return torch.float32
        return auto if auto != torch.bfloat16 or supported else torch.float32
    if name == Dtype.bfloat16 and not supported:
        raise UserError(f"{key}=bfloat16: this GPU ({torch.cuda.get_device_name(device)}) has no native bfloat16"
                        f" (it needs compute capability 8.0, Ampere, or newer); use {key}=float32 or auto")
    return DTYPES[name]


def matmul_precision(name: MatmulPrecision, device: torch.device) -> str:
    """torch.set_float32_matmul_precision's value: `auto` is `high` on a GPU (TF32 tensor
    cores for float32 matmuls: ~8x the float32 peak, a 10-bit mantissa for the products,
    float32 accumulation) and `highest` on the CPU (exact float32, as the tests compare)."""
    if name == MatmulPrecision.auto:
        return "high" if device.type == "cuda" else "highest"
    return MATMUL[name]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The forward's autocast (mixed precision without FSDP's policy): the same context in
    training and in evaluation, so a validation loss is computed as the training loss is."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
