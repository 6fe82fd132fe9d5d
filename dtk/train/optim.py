"""AdamW with linear warmup and cosine decay."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


class WarmupCosine:
    """lr multiplier at a step: 0 → 1 linearly over `warmup`, then cosine to `min_ratio` at `total`.

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


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: dict[str, Any], *, shard_group=None
) -> torch.optim.Optimizer:
    """AdamW; with `shard_group` ZeRO-1: each rank of the group keeps the state of its share
    of the parameters, steps that share and broadcasts the result."""
    if cfg["name"] != "adamw":
        raise ValueError(f"optim.name={cfg['name']}: no such optimizer (available: adamw)")
    params = list(params)
    # Weight decay on matrices only; norms and biases are not regularised.
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kwargs = {"lr": cfg["lr"], "betas": (cfg["beta1"], cfg["beta2"]), "eps": cfg["eps"], "foreach": True}
    if shard_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=shard_group, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def state_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state a checkpoint holds: under ZeRO-1 the rank's local one, so
    each rank saves (and loads) the state of exactly the parameters it steps."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


class SchedulerGroup:
    """One learning-rate schedule over several optimizers (one per pipeline stage a rank
    holds), stepped together and checkpointed as one."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]) -> None:
        assert schedulers, "at least one scheduler"
        self.schedulers = schedulers

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.load_state_dict(state)
            # Put the resumed rate into the optimizer too: a ZeRO-1 optimizer copies its own
            # param_groups' lr into the local optimizer at every step, so the value loaded
            # into the local optimizer alone would be overwritten.
            for group, lr in zip(s.optimizer.param_groups, s.get_last_lr(), strict=True):
                group["lr"] = lr


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: dict[str, Any], total_steps: int):
    schedule = WarmupCosine(warmup=cfg["warmup_steps"], total=total_steps, min_ratio=cfg["min_lr_ratio"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
