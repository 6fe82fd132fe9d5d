"""The loss of a run: one object, made once by the worker and handed to everything that
computes it - the trainer (micro-batch by micro-batch), a pipeline schedule (on its last
stage) and the evaluator (summed over the validation set). Making the loss a user's own
changes the one line that makes it.

A loss is called as `loss(output, targets)` and returns the mean over the micro-batch (what
backward and a pipeline schedule take), and `loss.total(output, targets)` returns the sum
and the number of terms, so an evaluation can average over any number of batches exactly.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


class Loss(Protocol):
    # Positional: an implementation names its arguments as it likes (logits, predictions).
    def __call__(self, output: torch.Tensor, targets: torch.Tensor, /) -> torch.Tensor: ...
    def total(self, output: torch.Tensor, targets: torch.Tensor, /) -> tuple[torch.Tensor, int]: ...


def _in_loss_parallel() -> bool:
    """Whether torch's loss_parallel is on already: a pipeline's step runs under it, around
    the loss of each micro-batch and its backward. Its exit is not reentrant (it drops the
    sharded-loss ops), so an inner one would leave the backward without them."""
    return torch.ops.aten._log_softmax.default in DTensor._op_dispatcher._custom_op_handlers


def sharded_context(output: torch.Tensor):
    """torch's loss_parallel around a loss (and its backward) of logits sharded over the
    vocabulary (a DTensor from a tensor-parallel head); nothing for plain logits, or when
    it is on already."""
    if isinstance(output, DTensor) and not _in_loss_parallel():
        return loss_parallel()
    return contextlib.nullcontext()


def local_value(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a loss: a replicated DTensor's local value is the whole value."""
    return t.to_local() if isinstance(t, DTensor) else t


# Logits cast to float32 a chunk of rows at a time, at most this many elements (256 MB in
# float32); at a 128k vocabulary a whole micro-batch's cast is several GB.
LOSS_CHUNK_ELEMENTS = 2**26


def _summed_float32(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def chunked_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, *, rows: int) -> torch.Tensor:
    """Sum of the cross-entropy over (rows, vocabulary) logits of a low-precision dtype,
    `rows` at a time: each chunk is cast to float32, reduced and dropped; its backward
    recomputes it (activation checkpointing), so no full float32 copy is ever held."""
    from torch.utils.checkpoint import checkpoint

    parts = [checkpoint(_summed_float32, lg, tg, use_reentrant=False)
             for lg, tg in zip(logits.split(rows), targets.split(rows), strict=True)]
    return torch.stack(parts).sum()


class TokenCrossEntropy:
    """Next-token cross-entropy over (batch, sequence, vocabulary) logits, in float32
    whatever the logits' dtype. Logits sharded over the vocabulary (tensor parallel) are
    never gathered: the loss runs on the shards, and so must its backward (the trainer
    calls it under `sharded_context`). Plain low-precision logits larger than
    `chunk_elements` are cast chunk by chunk (chunked_cross_entropy_sum)."""

    sharded_logits = True  # accepts vocabulary-sharded DTensor logits (dtk.parallel.tp)

    def __init__(self, chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> None:
        self.chunk_elements = chunk_elements

    def _rows(self, logits: torch.Tensor) -> int | None:
        """Rows per chunk, or None where the whole cast is fine (float32 already, a small
        output, or vocabulary shards, which loss_parallel reduces on their own)."""
        if isinstance(logits, DTensor) or logits.dtype == torch.float32 or logits.numel() <= self.chunk_elements:
            return None
        return max(1, self.chunk_elements // logits.shape[-1])

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = self._rows(logits)
        if rows is not None:
            return chunked_cross_entropy_sum(logits.flatten(0, 1), targets.flatten(), rows=rows) / targets.numel()
        with sharded_context(logits):
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def total(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        rows = self._rows(logits)
        if rows is not None:
            return chunked_cross_entropy_sum(logits.flatten(0, 1), targets.flatten(), rows=rows), targets.numel()
        with sharded_context(logits):
            summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return local_value(summed), targets.numel()
