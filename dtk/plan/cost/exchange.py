"""What exchanging less keeps on a rank beside the model: +sync's anchor, outer momentum and
the copies a synchronization makes (dtk.train.sync), PowerSGD's error feedback and P and Q
matrices (dtk.parallel.compression). Part of the memory budget (dtk.plan.cost.memory adds them
to a rank's buffers); pure arithmetic, no torch."""

from __future__ import annotations

import math
from typing import Protocol

from dtk.config.choices import GradCompression
from dtk.config.schema import SchemeConfig
from dtk.plan.degrees import Degrees
from dtk.plan.layout import RankLayout, uses_ddp


class ExchangingJob(Protocol):
    """The fields of dtk.plan.cost.memory.Job that say how the replicas exchange."""

    @property
    def scheme(self) -> SchemeConfig: ...
    @property
    def degrees(self) -> Degrees: ...
    @property
    def sync_bytes(self) -> int: ...
    @property
    def sync_mode(self) -> str: ...
    @property
    def outer_momentum(self) -> float: ...
    @property
    def outer_nesterov(self) -> bool: ...
    @property
    def sync_fragments(self) -> int: ...


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
    if job.sync_mode:
        local = sum(h.numel for h in layout.held)
        out = {"sync_anchor": round(local * param_bytes)}
        if job.sync_mode == "diloco" and job.outer_momentum > 0:
            out["sync_outer_momentum"] = out["sync_anchor"]
        # one fragment at a time: whole tensors, about 1/fragments of the elements (at most one tensor more)
        largest = max((h.numel for h in layout.held), default=0)
        part = round(min(local, -(-local // job.sync_fragments) + (largest if job.sync_fragments > 1 else 0))
                     * param_bytes)
        if job.sync_mode == "diloco":
            sending = 2 * part + (part * job.sync_bytes // 4 if job.sync_bytes < 4 else 0)
            transient = max(sending, (3 if job.outer_nesterov else 2) * part)
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
