"""Activation checkpointing of each block: `full` recomputes the whole block in backward,
`selective` keeps the outputs of matmuls, attention and collectives and recomputes only
the cheap element-wise work (norms, activations, residual adds)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from dtk.common.errors import UserError
from dtk.config.choices import ActivationCheckpoint
from dtk.parallel.units import wrap_units


def _saved_ops() -> set:
    aten = torch.ops.aten
    names = [
        (aten, "mm"),
        (aten, "addmm"),
        (aten, "bmm"),
        (aten, "_scaled_dot_product_flash_attention"),
        (aten, "_scaled_dot_product_efficient_attention"),
        (aten, "_scaled_dot_product_cudnn_attention"),
        (aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (torch.ops._c10d_functional, "reduce_scatter_tensor"),
        (torch.ops._c10d_functional, "all_reduce"),
        (torch.ops._c10d_functional, "all_gather_into_tensor"),
    ]
    return {getattr(ns, name).default for ns, name in names if hasattr(ns, name)}


def _policy(saved: set, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(functools.partial(_policy, _saved_ops()))


def checkpoint_module(module: nn.Module, *, selective: bool) -> None:
    """Recompute `module`'s forward in backward. The forward is replaced on the instance,
    so parameter names (and checkpoints) stay as they were, and FSDP hooks on the module
    run outside the recomputed region."""
    inner = module.forward
    context_fn = _selective_context if selective else None

    def forward(*args, **kwargs):
        extra: dict[str, Any] = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward


def apply_ac(module: nn.Module, *, mode: ActivationCheckpoint, wrap_classes: tuple[str, ...]) -> None:
    if mode == ActivationCheckpoint.none:
        return
    blocks = wrap_units(module, wrap_classes)
    if not blocks:
        raise UserError(
            f"activation checkpointing needs the model's blocks, but model.wrap_classes={list(wrap_classes)}"
            " matches no module of this model part"
        )
    for _, block in blocks:
        checkpoint_module(block, selective=mode == ActivationCheckpoint.selective)
