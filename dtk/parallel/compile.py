"""torch.compile per block: the blocks are identical, so one compiled graph serves all of
them (dynamo caches by code), and compile time stays that of one block.

`fullgraph=True` (scheme.compile_fullgraph): a block that cannot be one graph is an error
at its first forward, naming the break - a graph break under tensor parallelism or FSDP
splits the block into pieces run eagerly in between, a slowdown nobody sees otherwise.
With fullgraph off, breaks are allowed and each is logged once (torch's graph_breaks log).
"""

from __future__ import annotations

import torch
from torch import nn

from dtk.parallel.units import wrap_units


def apply_compile(module: nn.Module, *, wrap_classes: tuple[str, ...], fullgraph: bool, backend: str = "inductor") -> None:
    if not fullgraph:
        torch._logging.set_logs(graph_breaks=True)  # each break, with its reason, once
    # Module.compile() compiles in place: parameter names keep no `_orig_mod.` prefix.
    blocks = wrap_units(module, wrap_classes)
    for _, block in blocks or [("", module)]:
        block.compile(fullgraph=fullgraph, backend=backend)
