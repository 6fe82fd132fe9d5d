"""Per-rank batches for a training step, prepared one step ahead in a thread."""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from dtk.data.order import GlobalOrder, rank_share


class TokenDataset(Protocol):
    version: str

    def __len__(self) -> int: ...
    def get(self, ids: np.ndarray) -> np.ndarray: ...


def build_dataset(data_cfg: dict[str, Any], model_cfg: dict[str, Any]) -> TokenDataset:
    kind = data_cfg.get("kind", "synthetic")
    if kind == "synthetic":
        from dtk.data.synthetic import SyntheticTokens

        return SyntheticTokens(
            num_samples=data_cfg["num_samples"],
            seq_len=model_cfg["seq_len"],
            vocab_size=model_cfg["vocab_size"],
            seed=data_cfg["seed"],
            branching=data_cfg["branching"],
        )
    raise ValueError(f"data.kind={kind}: no such data source (available: synthetic)")


class StepBatches:
    """Micro-batches (inputs, targets) of this rank for each step, one step prefetched."""

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        seed: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
    ) -> None:
        self.dataset = dataset
        self.order = GlobalOrder(len(dataset), seed)
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtk-data")
        self._lock = threading.Lock()  # GlobalOrder caches permutations; one thread at a time
        self._ahead: tuple[int, Future] | None = None

    def _load(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with self._lock:
            ids = rank_share(self.order.global_batch(step, self.global_batch), self.dp_rank, self.dp_size)
        rows = torch.from_numpy(self.dataset.get(ids))
        micro = [rows[i : i + self.micro_batch] for i in range(0, len(rows), self.micro_batch)]
        return [(m[:, :-1].to(self.device), m[:, 1:].to(self.device)) for m in micro]

    def global_hash(self, step: int) -> str:
        """Fingerprint of the global batch of `step`: equal across world sizes iff the order is."""
        with self._lock:
            ids = self.order.global_batch(step, self.global_batch)
        return hashlib.blake2b(ids.tobytes(), digest_size=8).hexdigest()

    def get(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._ahead is not None and self._ahead[0] == step:
            batches = self._ahead[1].result()
        else:
            batches = self._load(step)
        self._ahead = (step + 1, self._pool.submit(self._load, step + 1))
        return batches

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
