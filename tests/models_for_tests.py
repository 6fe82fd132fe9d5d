"""A user's model, as a team would write it: nothing of dtk imported, no dtk hooks.

dtk learns how to parallelize it from the model's yaml alone (the test writes it: see tests/test_schemes_user_model.py):
the block class for FSDP, a tensor-parallel plan and the pipeline split points. Its one
concession to pipelining is the usual one: forward skips top-level modules that are None.
It keeps PyTorch's default initialisation (no `reset_parameter`), so dtk initialises it
from a seeded CPU build.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn


class ResidualMLP(nn.Module):
    def __init__(self, width: int, expansion: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, expansion * width)
        self.down = nn.Linear(expansion * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MlpLM(nn.Module):
    """Predicts the next token from the current one through residual MLP blocks."""

    def __init__(self, vocab_size: int, width: int, depth: int, expansion: int) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(ResidualMLP(width, expansion) for _ in range(depth))
        self.final_norm: nn.Module | None = nn.LayerNorm(width)
        self.head: nn.Module | None = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


def build(*, vocab_size: int, width: int, depth: int, expansion: int = 4, seq_len: int = 64) -> MlpLM:
    """The factory named by `_target_`; `seq_len` is read by the data loader, not the model."""
    del seq_len
    return MlpLM(vocab_size, width, depth, expansion)


class OutOfMemoryLM(MlpLM):
    """Runs out of device memory in its forward, as a model too large for its device does
    (the error a CUDA allocation raises, raised on any device)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (raised by the test model)")


def build_out_of_memory(*, vocab_size: int, width: int, depth: int, expansion: int = 4, seq_len: int = 64) -> MlpLM:
    del seq_len
    return OutOfMemoryLM(vocab_size, width, depth, expansion)


class SlowLM(MlpLM):
    """A model whose every forward takes `sleep_s` seconds of honest work (a large model's
    micro-batch): a step of many micro-batches lasts several times fault.hang_timeout_s."""

    def __init__(self, vocab_size: int, width: int, depth: int, expansion: int, sleep_s: float) -> None:
        super().__init__(vocab_size, width, depth, expansion)
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":  # not while dtk counts the model's FLOPs on meta
            time.sleep(self.sleep_s)
        return super().forward(x)


def build_slow(*, vocab_size: int, width: int, depth: int, expansion: int = 4, seq_len: int = 64,
               sleep_s: float = 1.0) -> MlpLM:
    del seq_len
    return SlowLM(vocab_size, width, depth, expansion, sleep_s)


class SpikeLM(MlpLM):
    """Returns a huge (finite) loss on one batch: its `spike_at`-th training forward (0-based,
    counted in each process; evaluation runs without gradients and is not counted) scales its
    logits by 1e4, as a bad batch does to a model that trains on it."""

    def __init__(self, vocab_size: int, width: int, depth: int, expansion: int, spike_at: int) -> None:
        super().__init__(vocab_size, width, depth, expansion)
        self.spike_at = spike_at
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if not torch.is_grad_enabled():
            return logits
        self.forwards += 1
        return logits * 1e4 if self.forwards - 1 == self.spike_at else logits


def build_spike(*, vocab_size: int, width: int, depth: int, spike_at: int, expansion: int = 4,
                seq_len: int = 64) -> MlpLM:
    del seq_len
    return SpikeLM(vocab_size, width, depth, expansion, spike_at)


def build_worker_only_mistake(*, vocab_size: int, width: int, depth: int, expansion: int = 4,
                              seq_len: int = 64) -> MlpLM:
    """A mistake only a worker can see (say, a file the login node has and the nodes do not):
    the factory refuses in a worker's process (DTK_PLAN is set there, by the driver) and builds
    anywhere else, so the login node's checks, counting the model included, pass."""
    import os

    from dtk.common.errors import UserError

    if "DTK_PLAN" in os.environ:
        raise UserError(f"model.width={width}: this worker cannot build it (a test model's mistake only workers see)")
    del seq_len
    return MlpLM(vocab_size, width, depth, expansion)


def build_crashing(*, vocab_size: int, width: int, depth: int, expansion: int = 4, seq_len: int = 64) -> MlpLM:
    """A model whose factory fails at every start with a fault that differs between starts
    (its message names the process, as a failing node or device does): a crash, not a
    configuration error and not a repeated user error, which the driver relaunches until its
    budget is spent."""
    raise RuntimeError(f"the test model fails at every start (process {os.getpid()})")


class TiedMlpLM(MlpLM):
    """MlpLM whose embedding is its output head, tied as nanoGPT ties them
    (`wte.weight = lm_head.weight`): one (vocab_size, width) parameter."""

    def __init__(self, vocab_size: int, width: int, depth: int, expansion: int) -> None:
        super().__init__(vocab_size, width, depth, expansion)
        assert self.embed is not None and self.head is not None
        self.embed.weight = self.head.weight


def build_tied(*, vocab_size: int, width: int, depth: int, expansion: int = 4, seq_len: int = 64) -> MlpLM:
    del seq_len
    return TiedMlpLM(vocab_size, width, depth, expansion)
