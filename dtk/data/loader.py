"""Datasets of a `data` config, and per-rank batches for each step, read ahead in a thread.

A batch is what the dataset's `get(ids)` returns, as tensors: dtk's token data a (batch,
seq_len + 1) tensor of token ids (the task cuts inputs and targets from it), a user's
dataset its items stacked (a tensor, or a tuple / dict of them; dtk.data.batch).
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from dtk.config.choices import DataKind
from dtk.config.schema import ModelConfig
from dtk.data.batch import as_torch, micro_batches, tensors, to_device, transfer_for
from dtk.data.order import GlobalOrder, rank_share


class TokenDataset(Protocol):
    version: str

    def __len__(self) -> int: ...
    def get(self, ids: np.ndarray) -> np.ndarray: ...


def build_splits(data: Any, *, model: ModelConfig) -> tuple[TokenDataset, TokenDataset]:
    """(train, validation) datasets of the `data` section (SyntheticDataConfig,
    Hdf5DataConfig or UserDataConfig), identical on every rank. A user's training set
    carries `split` (dtk.data.user.Split), which the worker writes to RUN_DIR/data.json."""
    if data.kind == DataKind.user:
        from dtk.data.user import build_user_splits

        train, val, user_split = build_user_splits(
            target=data._target_, kwargs=dict(data.kwargs), val_fraction=data.val_fraction,
            split_seed=data.split_seed, version=data.version,
        )
        train.split = user_split
        return train, val
    if data.kind == DataKind.synthetic:
        from dtk.data.synthetic import SyntheticTokens

        # The plan refuses synthetic data for a model without seq_len and vocab_size.
        assert model.seq_len is not None and model.vocab_size is not None
        synthetic = SyntheticTokens(
            num_samples=data.num_samples,
            seq_len=model.seq_len,
            vocab_size=model.vocab_size,
            seed=data.seed,
            branching=data.branching,
        )
        return synthetic, synthetic.validation()
    assert data.kind == DataKind.hdf5, data.kind
    from dtk.data.hdf5 import Hdf5Tokens, check_model, split

    dataset = Hdf5Tokens(data.path, verify=data.verify)
    check_model(dataset, model)
    return split(dataset, val_fraction=data.val_fraction, seed=data.split_seed, val_shards=list(data.val_shards))


def build_dataset(data: Any, *, model: ModelConfig) -> TokenDataset:
    """The training split of the `data` section."""
    return build_splits(data, model=model)[0]


class StepBatches:
    """Micro-batches of this rank for each step, on its device. A loader thread reads the
    next `ahead` steps while the current one computes (reading is numpy gathers from memory
    or a memory-mapped file, which release the GIL for the copy)."""

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
        ahead: int = 2,
    ) -> None:
        self.dataset = dataset
        self.ahead = max(1, ahead)
        self.order = GlobalOrder(len(dataset), seed)
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = device
        self.transfer = transfer_for(device.type)
        # The loader thread's copies run on this stream (CUDA): the step's compute waits for
        # them by an event, so neither the host nor the compute stream blocks on a copy.
        self._stream = torch.cuda.Stream(device) if self.transfer.side_stream else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtk-data")
        self._lock = threading.Lock()  # GlobalOrder caches permutations; one thread at a time
        self._ahead: dict[int, Future] = {}

    def _load(self, step: int) -> tuple[list[Any], Any]:
        with self._lock:
            ids = rank_share(self.order.global_batch(step, self.global_batch), self.dp_rank, self.dp_size)
        batch = as_torch(self.dataset.get(ids))
        if self._stream is None:
            return [to_device(m, self.device, self.transfer) for m in micro_batches(batch, self.micro_batch)], None
        with torch.cuda.stream(self._stream):
            moved = [to_device(m, self.device, self.transfer) for m in micro_batches(batch, self.micro_batch)]
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return moved, copied

    def global_hash(self, step: int) -> str:
        """Fingerprint of the global batch of `step`: equal across world sizes iff the order is."""
        with self._lock:
            ids = self.order.global_batch(step, self.global_batch)
        return hashlib.blake2b(ids.tobytes(), digest_size=8).hexdigest()

    def get(self, step: int) -> list[Any]:
        pending = self._ahead.pop(step, None)
        batches, copied = pending.result() if pending is not None else self._load(step)
        if copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copied)  # queued: the host does not wait
            for t in tensors(batches):
                t.record_stream(compute)  # made on the side stream, used on this one
        for stale in [s for s in self._ahead if s < step]:
            self._ahead.pop(stale).cancel()
        for nxt in range(step + 1, step + 1 + self.ahead):
            if nxt not in self._ahead:
                self._ahead[nxt] = self._pool.submit(self._load, nxt)
        return batches

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
