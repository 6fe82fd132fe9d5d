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


def sharded_context(output: torch.Tensor):
    """torch's loss_parallel around a loss (and its backward) of logits sharded over the
    vocabulary (a DTensor from a tensor-parallel head); nothing for plain logits."""
    return loss_parallel() if isinstance(output, DTensor) else contextlib.nullcontext()


def local_value(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a loss: a replicated DTensor's local value is the whole value."""
    return t.to_local() if isinstance(t, DTensor) else t


class TokenCrossEntropy:
    """Next-token cross-entropy over (batch, sequence, vocabulary) logits, in float32
    whatever the logits' dtype. Logits sharded over the vocabulary (tensor parallel) are
    never gathered: the loss runs on the shards, and so must its backward (the trainer
    calls it under `sharded_context`)."""

    sharded_logits = True  # accepts vocabulary-sharded DTensor logits (dtk.parallel.tp)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with sharded_context(logits):
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def total(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        with sharded_context(logits):
            summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return local_value(summed), targets.numel()
