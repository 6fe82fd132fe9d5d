"""torch.compile per block: the blocks are identical, so one compiled graph serves all of
them (dynamo caches by code), and compile time stays that of one block."""

from __future__ import annotations

from torch import nn

from dtk.parallel.units import wrap_units


def apply_compile(module: nn.Module, *, wrap_classes: tuple[str, ...]) -> None:
    # Module.compile() compiles in place: parameter names keep no `_orig_mod.` prefix.
    blocks = wrap_units(module, wrap_classes)
    for _, block in blocks or [("", module)]:
        block.compile()
