"""The loss of a run: one object, made once by the worker and handed to everything that
computes it - the trainer (micro-batch by micro-batch), a pipeline schedule (on its last
stage) and the evaluator (summed over the validation set). Making the loss a user's own
changes the one line that makes it.

A loss is called as `loss(output, targets)` and returns the mean over the micro-batch (what
backward and a pipeline schedule take), and `loss.total(output, targets)` returns the sum
and the number of terms, so an evaluation can average over any number of batches exactly.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Loss(Protocol):
    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...
    def total(self, output: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]: ...


class TokenCrossEntropy:
    """Next-token cross-entropy over (batch, sequence, vocabulary) logits, in float32
    whatever the logits' dtype."""

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def total(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return summed, targets.numel()
