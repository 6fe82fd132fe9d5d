"""Build a model from `model._target_` and the other keys of the `model` config."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Keys of the model config that describe how to parallelize, not how to build.
PARALLEL_KEYS = ("wrap_classes", "tp_plan", "split_points")


def locate(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise ValueError(f"model._target_={target}: expected a dotted path like package.module.factory")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model._target_={target}: cannot import it ({exc})") from None


def build_model(cfg: dict[str, Any], *, seed: int) -> nn.Module:
    """Build on the CPU with a seeded generator, so every rank starts from the same weights."""
    factory = locate(cfg["_target_"])
    kwargs = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in PARALLEL_KEYS}
    torch.manual_seed(seed)
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model._target_={cfg['_target_']} returned {type(model).__name__}, not an nn.Module")
    if hasattr(model, "init_weights"):
        model.init_weights(torch.Generator().manual_seed(seed))
    return model
