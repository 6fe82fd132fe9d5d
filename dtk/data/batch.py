"""Batches of any structure: a tensor, or a tuple / list / dict of tensors (a user dataset's
items stacked by dtk.data.user.collate), moved, cut into micro-batches and measured as one.

dtk's own token data gives a (batch, seq_len + 1) tensor of token ids; a user's dataset
gives what its items are, stacked. Leaves that are not tensors (a list of strings) are cut
like lists and stay on the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dtk.common.errors import UserError


def as_torch(batch: Any) -> Any:
    """numpy arrays (dtk's token datasets return them) as tensors, the structure kept."""
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch)
    if isinstance(batch, Mapping):
        return {k: as_torch(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (str, bytes)):
        return type(batch)(as_torch(v) for v in batch)
    return batch


@dataclass(frozen=True)
class Transfer:
    """How host batches reach a device."""

    pinned: bool
    """Copy from page-locked host memory: a pageable copy to a GPU is staged by the driver
    and makes the host wait for it."""
    non_blocking: bool
    """The copy is queued on a stream and the host goes on (needs `pinned` to be asynchronous)."""
    side_stream: bool
    """The loader thread copies on a stream of its own, which the compute stream waits for
    (an event, no host sync): the copy of the next step overlaps this step's compute."""


def transfer_for(device_type: str) -> Transfer:
    """Pinned, non-blocking copies on a side stream to a CUDA device; plain ones elsewhere
    (to the CPU a copy is a no-op, and pinning would only cost)."""
    cuda = device_type == "cuda"
    return Transfer(pinned=cuda, non_blocking=cuda, side_stream=cuda)


def to_device(batch: Any, device: torch.device, transfer: Transfer | None = None) -> Any:
    """The batch's tensors on `device`, the structure kept; `transfer` None: transfer_for(device)."""
    transfer = transfer if transfer is not None else transfer_for(device.type)
    if isinstance(batch, torch.Tensor):
        if transfer.pinned and batch.device.type == "cpu" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=transfer.non_blocking)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, transfer) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (str, bytes)):
        return type(batch)(to_device(v, device, transfer) for v in batch)
    return batch


def tensors(batch: Any) -> list[torch.Tensor]:
    """The tensor leaves of a batch."""
    return [leaf for leaf in _leaves(batch) if isinstance(leaf, torch.Tensor)]


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
