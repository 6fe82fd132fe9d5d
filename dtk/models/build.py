"""Build a model from `model._target_` and its factory's keys (`ModelConfig.kwargs`).

A model is built on the meta device (no memory), parallelized, and only then given real
storage and initial values (`materialize`). The initial values never depend on how the
model was split or sharded, so every scheme starts exactly where one process would.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from dtk.common.errors import UserError
from dtk.config.schema import ModelConfig
from dtk.models.ties import ELSEWHERE, retie, tied_groups


@dataclass(frozen=True)
class ParallelSpec:
    """What the model config says about parallelizing the model (see docs/schemes.md)."""

    wrap_classes: tuple[str, ...] = ()
    """Class names (or dotted paths) of the repeated blocks: FSDP and activation-checkpoint units."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """Module path pattern -> tensor-parallel style (colwise, rowwise, colwise_output, ...)."""
    split_points: tuple[str, ...] = ()
    """Module paths where pipeline stages 1, 2, ... begin; empty: an even split of the blocks."""

    @staticmethod
    def from_config(model: ModelConfig) -> ParallelSpec:
        return ParallelSpec(
            wrap_classes=tuple(model.wrap_classes), tp_plan=dict(model.tp_plan), split_points=tuple(model.split_points)
        )

    def with_model_defaults(self, model: nn.Module) -> ParallelSpec:
        """A model may say how to parallelize itself (`dtk_wrap_classes`, `dtk_tp_plan` in
        dtk's style names: a Hugging Face model reads them from its own class); the yaml's
        `wrap_classes` and `tp_plan`, when given, win. A style dtk has no equivalent of stays
        in the plan as `unsupported:NAME`, refused only if tensor parallelism uses it."""
        wrap = self.wrap_classes or tuple(getattr(model, "dtk_wrap_classes", ()))
        plan = self.tp_plan or dict(getattr(model, "dtk_tp_plan", {}))
        return ParallelSpec(wrap_classes=wrap, tp_plan=plan, split_points=self.split_points)


def locate(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise UserError(f"model._target_={target}: expected a dotted path like package.module.factory")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"model._target_={target}: cannot import it ({exc})") from None


def check_arguments(target: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """The model section's keys against the factory's signature: a key it does not take, or
    one it needs that is missing, is the user's mistake (a TypeError from the call itself
    could come from anywhere inside the factory)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a callable without a signature to read (a C function)
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        takes = [n for n, p in signature.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise UserError(f"model._target_={target}: its keys do not fit the factory: {exc}; it takes"
                        f" {', '.join(takes) or 'no keyword arguments'} (the model section's other keys)") from None


def build_model(model_cfg: ModelConfig, *, device: str | torch.device, seed: int) -> nn.Module:
    """Call the factory under `device`. On "meta" nothing is allocated; `materialize` later
    gives the parameters storage and values. On a real device the model gets the initial
    values a distributed run starts from (see `materialize`)."""
    factory = locate(model_cfg._target_)
    check_arguments(model_cfg._target_, factory, model_cfg.kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = factory(**model_cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise UserError(f"model._target_={model_cfg._target_} returned {type(model).__name__}, not an nn.Module")
    if torch.device(device).type != "meta" and hasattr(model, "reset_parameter"):
        _init_by_name([model], seed)
    return model


def name_seed(seed: int, name: str) -> int:
    """A generator seed from (seed, parameter name): stable across processes and runs."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@runtime_checkable
class NamedInit(Protocol):
    """A model that draws each full tensor itself, by name (the built-in transformer)."""

    def reset_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None: ...


def _tensors(parts: Iterable[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor]]:
    out: list[tuple[nn.Module, str, torch.Tensor]] = []
    for part in parts:
        out += [(part, name, p) for name, p in part.named_parameters()]
        out += [(part, name, b) for name, b in part.named_buffers()]
    return out


@torch.no_grad()
def _assign(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` (the unsharded value) into `target`, which may be a DTensor shard of it:
    each rank keeps only its own piece."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        full = full.to(device=target.device, dtype=target.dtype)
        # src_data_rank=None: every rank already holds the full value; no communication.
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def _init_by_name(parts: list[nn.Module], seed: int) -> None:
    """Each full tensor is drawn on the device its shard lives on, from a generator of that
    device: on a GPU the draw takes milliseconds where the CPU takes minutes for a large
    model, and no full tensor crosses the host-device link. Values depend on (seed, name)
    and the device type only: every scheme and world size starts from the same weights on
    the same GPUs (a GPU's stream differs from the CPU's, so a CPU run starts elsewhere)."""
    for part, name, t in _tensors(parts):
        # A pipeline stage's copy of a weight tied to another stage's: the first name's values.
        name = getattr(part, ELSEWHERE, {}).get(name, name)
        full = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        generator = torch.Generator(device=t.device).manual_seed(name_seed(seed, name))
        assert isinstance(part, NamedInit), "every part of one model initialises alike"
        part.reset_parameter(name, full, generator)
        _assign(t, full)


def materialize(parts: list[nn.Module], *, model_cfg: ModelConfig, device: torch.device, seed: int) -> None:
    """Give meta parameters storage on `device` and their initial values.

    A model with `reset_parameter(name, full, generator)` fills each full tensor from a
    generator seeded by (seed, name), one tensor at a time on the shards' device, so memory
    stays one parameter above the shards. Any other model is built once more on the CPU under `seed` with
    its own initialisation, and each rank copies its shards from that reference (memory:
    one full model on the host while starting).

    Tied parameters (an output head that is the token embedding) stay one parameter:
    `to_empty` gives each module its own tensor, so the ties are found before it and
    restored after it (dtk.models.ties); the tensor takes the values of its first name."""
    for part in parts:
        ties = tied_groups(part)
        part.to_empty(device=device)
        retie(part, ties)
    if isinstance(parts[0], NamedInit):
        _init_by_name(parts, seed)
        return
    reference = build_model(model_cfg, device="cpu", seed=seed)
    # Every name of a tied parameter: a part may hold it under a later name only.
    values: dict[str, torch.Tensor] = dict(reference.named_parameters(remove_duplicate=False))
    values.update(reference.named_buffers())
    for _, name, t in _tensors(parts):
        if name not in values:
            raise UserError(
                f"model._target_={model_cfg._target_}: parameter {name} is not in a fresh build of the model"
            )
        _assign(t, values[name].detach())
