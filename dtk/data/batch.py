"""Batches of any structure: a tensor, or a tuple / list / dict of tensors (a user dataset's
items stacked by dtk.data.user.collate), moved, cut into micro-batches and measured as one.

dtk's own token data gives a (batch, seq_len + 1) tensor of token ids; a user's dataset
gives what its items are, stacked. Leaves that are not tensors (a list of strings) are cut
like lists and stay on the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dtk.errors import UserError


def as_torch(batch: Any) -> Any:
    """numpy arrays (dtk's token datasets return them) as tensors, the structure kept."""
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch)
    if isinstance(batch, Mapping):
        return {k: as_torch(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (str, bytes)):
        return type(batch)(as_torch(v) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (str, bytes)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _leaves(batch: Any) -> list[Any]:
    if isinstance(batch, Mapping):
        return [leaf for v in batch.values() for leaf in _leaves(v)]
    if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (str, bytes)):
        return [leaf for v in batch for leaf in _leaves(v)]
    return [batch]


def batch_size(batch: Any) -> int:
    """Samples in a batch: the length of its leaves, which must agree."""
    sizes = {len(leaf) for leaf in _leaves(batch)}
    if len(sizes) != 1:
        raise UserError(f"a batch whose parts have different lengths {sorted(sizes)}: every part must hold one row per sample")
    return sizes.pop()


def rows(batch: Any, start: int, stop: int) -> Any:
    """Samples [start, stop) of a batch, the structure kept."""
    if isinstance(batch, Mapping):
        return {k: rows(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (str, bytes)):
        return type(batch)(rows(v, start, stop) for v in batch)
    return batch[start:stop]


def micro_batches(batch: Any, size: int) -> list[Any]:
    """A batch cut into consecutive micro-batches of `size` samples."""
    n = batch_size(batch)
    return [rows(batch, i, i + size) for i in range(0, n, size)]
