"""World-size-invariant sample order.

Epoch e visits the samples in the permutation drawn from (seed, e). Training consumes that
stream in global batches: global batch k is positions [k*B, (k+1)*B) of the stream, and
data-parallel rank r of D takes the r-th contiguous D-th of it. The loader's whole state
is the number of samples consumed, so it reshards to any D that divides B.

    stream:   | epoch 0 permutation ............ | epoch 1 permutation ...
    batch k:              [ rank 0 | rank 1 | ... | rank D-1 ]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dtk.common.errors import UserError


class GlobalOrder:
    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise UserError(f"dataset has {num_samples} samples; expected at least 1")
        self.num_samples = num_samples
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perms = {epoch: perm, **{e: p for e, p in self._perms.items() if e == epoch - 1}}
        return perm

    def ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids at stream positions [start, start + count)."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            epoch, pos = divmod(start + filled, self.num_samples)
            take = min(count - filled, self.num_samples - pos)
            out[filled : filled + take] = self.permutation(epoch)[pos : pos + take]
            filled += take
        return out

    def global_batch(self, step: int, global_batch: int) -> np.ndarray:
        return self.ids(step * global_batch, global_batch)


def rank_share(batch_ids: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    """The contiguous part of a global batch that one data-parallel rank trains on."""
    if len(batch_ids) % dp_size:
        raise UserError(f"global batch {len(batch_ids)} does not split over {dp_size} data-parallel ranks")
    per = len(batch_ids) // dp_size
    return batch_ids[dp_rank * per : (dp_rank + 1) * per]


def data_step(index: int, skips: list[dict[str, Any]]) -> int:
    """The global batch of the stream that training step `index` (0-based) reads, given the
    data windows skipped after a divergence (RUN_DIR/data_skips.json, dtk.train.divergence):
    each window moves every step from its first bad one (`from_step`, completed steps) on
    past the window's `num_steps` batches."""
    return index + sum(s["num_steps"] for s in skips if index >= s["from_step"] - 1)
