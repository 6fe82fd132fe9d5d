"""Finding a model's parallelism units by the names its config gives.

`wrap_classes` name the repeated blocks (FSDP and activation-checkpoint units);
`tp_plan` patterns name modules by path; pipeline stages are runs of top-level modules
and container items (see `pipeline_units`).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def class_matches(module: nn.Module, names: tuple[str, ...]) -> bool:
    cls = type(module)
    return cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names


def wrap_units(model: nn.Module, wrap_classes: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The modules of the wrap classes, outermost only (a block inside a block is part of it)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and class_matches(module, wrap_classes):
            if not any(name.startswith(f"{outer}.") for outer, _ in found):
                found.append((name, module))
    return found


def pattern_matches(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Modules whose dotted path matches the shell-style pattern (`layers.*.attn.wq`)."""
    return [(name, m) for name, m in model.named_modules() if name and fnmatchcase(name, pattern)]


def pipeline_units(model: nn.Module) -> list[tuple[str, bool]]:
    """The model's units in forward order, as (path, is_block).

    Top-level children are units; a container child (ModuleList, ModuleDict, Sequential)
    contributes each of its items as a unit instead, marked as a block. A model that is
    itself a Sequential has only blocks. This assumes registration order is forward
    order, as it is in nearly every model."""
    if isinstance(model, CONTAINERS):
        return [(name, True) for name, _ in model.named_children()]
    units = []
    for name, child in model.named_children():
        if isinstance(child, CONTAINERS):
            units += [(f"{name}.{item}", True) for item, _ in child.named_children()]
        else:
            units.append((name, False))
    return units
