"""AdamW with linear warmup and cosine decay."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from dtk.config.choices import OptimizerName
from dtk.config.schema import OptimConfig


class WarmupCosine:
    """lr multiplier at a step: 0 -> 1 linearly over `warmup`, then cosine to `min_ratio` at `total`.

    A class, not a lambda, so the schedule pickles and its parameters show in state_dict.
    """

    def __init__(self, *, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter], *, optim: OptimConfig, shard_group=None,
                    reduces_gradients: bool = False):
    """The optimizer `optim.name` names; with `shard_group` ZeRO-1 (dtk.parallel.zero): each
    rank of the group keeps the state of its share of the parameters only, and with
    `reduces_gradients` (no DDP wrapper: tensor parallel) all-reduces the gradients itself."""
    make = OPTIMIZERS[optim.name]
    if shard_group is not None:
        from dtk.parallel.zero import ZeroOptimizer

        return ZeroOptimizer(list(params), lambda share: make(share, optim), group=shard_group,
                             reduces_gradients=reduces_gradients)
    return make(list(params), optim)


def _adamw(params: list[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.Optimizer:
    from torch.distributed.tensor import DTensor

    groups = []
    # Weight decay on matrices only; norms and biases are not regularised. Plain tensors and
    # DTensors (tensor parallel without FSDP leaves unplanned modules plain) go in groups
    # of their own: the fused multi-tensor update cannot mix them.
    for decay in (True, False):
        for sharded in (True, False):
            picked = [p for p in params if (p.ndim >= 2) == decay and isinstance(p, DTensor) == sharded]
            if picked:
                groups.append({"params": picked, "weight_decay": optim.weight_decay if decay else 0.0})
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                             **adamw_kernel({p.device.type for p in params}))


def adamw_kernel(device_types: set[str]) -> dict[str, bool]:
    """AdamW's implementation for parameters on these device types: the fused kernel (one
    launch per group, DTensors included: torch dispatches it on their local shards) where
    every parameter is on a CUDA device, the multi-tensor foreach one elsewhere (the CPU of
    the tests, where fused would change the numbers against the references)."""
    return {"fused": True} if device_types == {"cuda"} else {"foreach": True}


# Each optimizer of the schema (dtk/config/choices.py) and how it is made; a test checks that
# every OptimizerName member is here.
OPTIMIZERS = {OptimizerName.adamw: _adamw}


def state_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that holds the state: the rank's local one under ZeRO-1. A
    checkpoint and the learning-rate schedule attach to it."""
    return getattr(optimizer, "local", optimizer)


class SchedulerGroup:
    """One learning-rate schedule over several optimizers (one per pipeline stage a rank
    holds), stepped together and checkpointed as one.

    Its state is the step count alone, not torch's per-param-group lists: the groups of an
    optimizer differ between schemes (ZeRO-1 shares, tensor-parallel splits), and a
    checkpoint must load under any of them."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LambdaLR]) -> None:
        assert schedulers, "at least one scheduler"
        self.schedulers = schedulers

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return [float(lr) for lr in self.schedulers[0].get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        first = self.schedulers[0]
        return {"last_epoch": first.last_epoch, "_step_count": first._step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.last_epoch = state["last_epoch"]
            s._step_count = state.get("_step_count", state["last_epoch"] + 1)
            lrs = [base * fn(s.last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas, strict=True)]
            for group, lr in zip(s.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            s._last_lr = lrs


def build_scheduler(optimizer: torch.optim.Optimizer, *, optim: OptimConfig, total_steps: int):
    schedule = WarmupCosine(warmup=optim.warmup_steps, total=total_steps, min_ratio=optim.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
