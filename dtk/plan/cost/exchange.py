"""What exchanging less keeps on a rank beside the model: +sync's anchor, outer momentum and
the copies a synchronization makes (dtk.train.sync), PowerSGD's error feedback and P and Q
matrices (dtk.parallel.compression). Part of the memory budget (dtk.plan.cost.memory adds them
to a rank's buffers); pure arithmetic, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from dtk.config.choices import GradCompression, SyncDtype, SyncMode
from dtk.config.schema import SchemeConfig, SyncConfig
from dtk.plan.degrees import Degrees
from dtk.plan.layout import RankLayout, uses_ddp


@dataclass(frozen=True)
class Exchange:
    """How the replicas exchange under +sync, as the budget and the step time read it; the
    default is every step (no +sync)."""

    every: int = 0
    """sync.every: the replicas all-reduce their parameters every this many steps instead of
    their gradients every step (dtk.plan.cost.comm); 0: every step."""
    element_bytes: int = 4
    """Bytes per element of that all-reduce (2 with sync.dtype=bfloat16)."""
    mode: str = ""
    """`local_sgd` or `diloco`, empty without +sync: what the synchronizer keeps."""
    outer_momentum: float = 0.0
    """diloco: sync.outer_momentum (above 0 the outer SGD keeps a momentum buffer per parameter)."""
    outer_nesterov: bool = False
    """diloco: sync.outer_nesterov (its step makes one more temporary copy)."""
    fragments: int = 1
    """sync.fragments (a synchronization's copies are of one fragment)."""

    @classmethod
    def of(cls, sync: SyncConfig | None) -> Exchange:
        """The exchange of a run's `sync` section (None: every step)."""
        if sync is None:
            return cls()
        diloco = sync.mode == SyncMode.diloco
        return cls(every=sync.every, element_bytes=2 if sync.dtype == SyncDtype.bfloat16 else 4,
                   mode=str(sync.mode), outer_momentum=sync.outer_momentum if diloco else 0.0,
                   outer_nesterov=diloco and sync.outer_nesterov, fragments=sync.fragments)


class ExchangingJob(Protocol):
    """The fields of dtk.plan.cost.memory.Job that say how the replicas exchange."""

    @property
    def scheme(self) -> SchemeConfig: ...
    @property
    def degrees(self) -> Degrees: ...
    @property
    def sync(self) -> Exchange: ...


SYNC_KEYS = ("sync_anchor", "sync_outer_momentum", "sync_exchange")
POWERSGD_MIN_RATE = 2
"""PowerSGD compresses a matrix only where (rows + columns) x rank x this < its elements (torch's min_compression_rate)."""


def powersgd_factors(shape: tuple[int, ...], rank: int) -> tuple[int, int] | None:
    """(P, Q) elements PowerSGD keeps for a gradient of `shape` (rows x rank, columns x rank,
    the matrix viewed as shape[0] rows), or None when it sends the tensor whole: 1-D, or
    not shrunk POWERSGD_MIN_RATE-fold (torch's powerSGD_hook's rule)."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = math.prod(shape) // max(n, 1)
    r = min(n, m, rank)
    return (n * r, m * r) if (n + m) * r * POWERSGD_MIN_RATE < n * m else None


def exchange_state(job: ExchangingJob, layout: RankLayout, *, freed: int, param_bytes: float,
                   grad_bytes: float) -> dict[str, int]:
    """Bytes the replicas' exchange keeps on a rank beside the model, by name.

    +sync (dtk.train.sync): `sync_anchor`, the parameters of the last synchronization (a
    copy of this rank's parameters: its FSDP shard under HSDP); `sync_outer_momentum`,
    diloco's outer SGD momentum buffer (outer_momentum > 0), as large; `sync_exchange`, the
    flat copies a synchronization makes of its fragment (sync.fragments; local_sgd: the
    parameters; diloco: the deltas and their flat copy, then the outer gradient beside the
    mean, one more with Nesterov, and a bfloat16 copy with sync.dtype=bfloat16), counted
    where they exceed what the step frees
    before it (`freed`: the gradients, set to None after the optimizer step, and the
    activations).

    scheme.grad_compression=powersgd (dtk.parallel.compression, torch's powerSGD_hook):
    `powersgd_error`, the error feedback (one buffer as large as each bucket's gradients);
    `powersgd_pq`, every compressed matrix's P and Q (kept between steps: warm start);
    `powersgd_bucket`, the hook's copy of a bucket and its new error (two buckets of
    scheme.bucket_cap_mb at most)."""
    sync = job.sync
    if sync.mode:
        local = sum(h.numel for h in layout.held)
        out = {"sync_anchor": round(local * param_bytes)}
        if sync.mode == "diloco" and sync.outer_momentum > 0:
            out["sync_outer_momentum"] = out["sync_anchor"]
        # one fragment at a time: whole tensors, about 1/fragments of the elements (at most one tensor more)
        largest = max((h.numel for h in layout.held), default=0)
        part = round(min(local, -(-local // sync.fragments) + (largest if sync.fragments > 1 else 0))
                     * param_bytes)
        if sync.mode == "diloco":
            sending = 2 * part + (part * sync.element_bytes // 4 if sync.element_bytes < 4 else 0)
            transient = max(sending, (3 if sync.outer_nesterov else 2) * part)
        else:
            transient = part
        out["sync_exchange"] = max(0, transient - freed)
        return out
    if job.scheme.grad_compression != GradCompression.powersgd or not uses_ddp(job.scheme, job.degrees):
        return {}
    factors = [powersgd_factors(h.tensor.shape, job.scheme.powersgd_rank) for h in layout.held]
    grads = round(sum(h.grad_numel for h in layout.held) * grad_bytes)
    return {
        "powersgd_error": grads,
        "powersgd_pq": round(sum(sum(f) for f in factors if f) * grad_bytes),
        "powersgd_bucket": 2 * min(grads, job.scheme.bucket_cap_mb * 2**20),
    }
