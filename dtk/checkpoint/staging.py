"""The async save's copy of the state into host buffers, without holding the GIL.

DCP's stager (`DefaultStager`, its `StateDictStager`) copies each tensor's storage with
`UntypedStorage.copy_`, which holds the GIL for the whole copy: while the stager's thread
copies a 67 MB storage the training thread cannot run a line of Python (measured: the main
thread of a process whose second thread stages 600 MB woke every 25 ms instead of every
0.5 ms), so the copy that should overlap the next step's forward stalls it instead. Here
the same copy goes through byte views of the two storages as tensors, whose `copy_`
releases the GIL like any tensor op; everything else (buffers cached from one save to the
next, shared or pinned memory, the copy stream) is DCP's.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Stager(StateDictStager):
    def _stage_untyped_storage(self, storage, non_blocking: bool = False):
        cached = self._cached_storage_mapping.get(storage)
        if cached is None or cached.size() != storage.size():
            # the first save of this storage: DCP allocates (shared or pinned memory) and copies
            return super()._stage_untyped_storage(storage, non_blocking=non_blocking)
        _as_bytes(cached).copy_(_as_bytes(storage), non_blocking=non_blocking)
        return cached


def stager(options: StagingOptions) -> DefaultStager:
    """DCP's DefaultStager whose copies of later saves release the GIL (the first save's
    allocating copy is DCP's own)."""
    staging = DefaultStager(options)
    own = getattr(staging, "_state_dict_stager", None)
    if isinstance(own, StateDictStager):  # torch's layout as of 2.9-2.13; otherwise DCP's copy stays
        replacement = _Stager(pin_memory=own.pin_memory, share_memory=own.share_memory)
        replacement.pin_memory_min_bytes = own.pin_memory_min_bytes
        staging._state_dict_stager = replacement
    return staging
