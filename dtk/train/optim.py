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


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: dict[str, Any]) -> torch.optim.Optimizer:
    if cfg["name"] != "adamw":
        raise ValueError(f"optim.name={cfg['name']}: no such optimizer (available: adamw)")
    params = list(params)
    # Weight decay on matrices only; norms and biases are not regularised.
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg["lr"],
        betas=(cfg["beta1"], cfg["beta2"]),
        eps=cfg["eps"],
        foreach=True,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: dict[str, Any], total_steps: int):
    schedule = WarmupCosine(warmup=cfg["warmup_steps"], total=total_steps, min_ratio=cfg["min_lr_ratio"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
