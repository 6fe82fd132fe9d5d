"""The schema of the `sync` section: replicas that synchronize every H steps instead of every
step (part of dtk/config/schema.py, which imports it; kept here to keep each module short).
docs/schemes.md, "Synchronizing less often", says when each mode pays off."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtk.common.errors import UserError
from dtk.config.choices import SyncDtype, SyncMode
from dtk.config.fields import IDENTITY


@dataclass
class SyncConfig:
    """Chosen with `+sync=local_sgd` or `+sync=diloco`; without it every step synchronizes."""

    mode: SyncMode = field(default=SyncMode.local_sgd, metadata=IDENTITY)
    """`local_sgd`: each data-parallel replica takes `every` optimizer steps on its own data, then the replicas average their parameters. `diloco`: the same inner steps, then the replicas average their parameter deltas since the last synchronization and an outer optimizer (SGD, `outer_lr`, `outer_momentum`) applies them."""
    every: int = field(default=8, metadata=IDENTITY)
    """Optimizer steps between two synchronizations (H); >= 1. 1 with local_sgd and plain SGD is every-step data parallelism."""
    outer_lr: float = field(default=0.7, metadata=IDENTITY)
    """diloco: learning rate of the outer SGD (the DiLoCo paper's 0.7). Ignored by local_sgd."""
    outer_momentum: float = field(default=0.9, metadata=IDENTITY)
    """diloco: momentum of the outer SGD, in [0, 1) (the DiLoCo paper's 0.9). Ignored by local_sgd."""
    outer_nesterov: bool = field(default=True, metadata=IDENTITY)
    """diloco: Nesterov momentum in the outer SGD (the DiLoCo paper's). Needs outer_momentum > 0."""
    dtype: SyncDtype = field(default=SyncDtype.float32, metadata=IDENTITY)
    """diloco: what the replicas all-reduce of their deltas: `float32`, or `bfloat16` (half the bytes; the sum is taken in bfloat16). local_sgd averages the parameters themselves and takes float32 only."""
    fragments: int = field(default=1, metadata=IDENTITY)
    """Streaming: the parameters cut into this many fragments (whole tensors, in the model's order, about equal in elements), synchronized in turn: fragment f after the steps s with s % every == f x every/fragments, each every `every` steps, so one all-reduce of 1/fragments of the model every every/fragments steps. Must divide `every`, and be at most the model's number of trainable tensors. 1: the whole model at once."""


def check_fragments(sync: SyncConfig | None) -> None:
    """sync.fragments on its own and against sync.every (the cut against the model's tensors
    is the worker's check: dtk.train.sync.fragments_of)."""
    if sync is None:
        return
    if sync.fragments < 1:
        raise UserError(f"sync.fragments={sync.fragments}: expected a number of fragments >= 1, like 2 (1: the whole"
                        " model synchronizes at once)")
    if sync.every % sync.fragments:
        fits = [f for f in range(1, sync.every + 1) if sync.every % f == 0]
        raise UserError(f"sync.fragments={sync.fragments} does not divide sync.every={sync.every}: fragments are"
                        f" synchronized every/fragments steps apart; try sync.fragments in {fits}")
