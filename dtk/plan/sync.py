"""Plan-time checks of the ways replicas exchange less: synchronizing every `sync.every` steps
(`+sync=local_sgd|diloco`, dtk/train/sync.py) and compressing DDP's every-step gradient
all-reduce (`scheme.grad_compression`, dtk/parallel/compression.py). Pure, torch-free: a
mistake stops on the login node with one line."""

from __future__ import annotations

from dtk.config.choices import DataParallel, GradCompression, SyncDtype, SyncMode
from dtk.config.schema import SchemeConfig, SyncConfig
from dtk.errors import UserError
from dtk.plan.degrees import Degrees
from dtk.plan.layout import uses_ddp


def check_sync(sync: SyncConfig | None, scheme: SchemeConfig, degrees: Degrees, *, memory_every: int) -> None:
    """`+sync=...` against the scheme: replicas to average over, and only the layouts built."""
    if sync is None:
        return
    key = f"+sync={sync.mode}"
    if sync.every < 1:
        raise UserError(f"sync.every={sync.every}: expected optimizer steps between synchronizations >= 1, like 8")
    if degrees.dp_replicate < 2:
        raise UserError(
            f"{key} with scheme.dp_replicate={degrees.dp_replicate}: there is one data-parallel replica, nothing to"
            " synchronize with; use >= 2 replicas (scheme.dp_replicate=2, or +scheme=ddp on >= 2 workers)"
        )
    if degrees.tp > 1 or degrees.pp > 1 or degrees.cp > 1:
        raise UserError(
            f"{key} with scheme.tp={degrees.tp}, scheme.pp={degrees.pp}, scheme.cp={degrees.cp}: synchronizing less"
            " often is built for replicas that are plain DDP-style copies or FSDP inside a replica (+scheme=ddp or"
            " +scheme=hsdp); use tp=1, pp=1 and cp=1"
        )
    if scheme.shard_optimizer:
        raise UserError(f"{key} with scheme.shard_optimizer=true: each replica keeps its own optimizer state;"
                        " set scheme.shard_optimizer=false (or use +scheme=hsdp to shard inside a replica)")
    if scheme.grad_compression != GradCompression.none:
        raise UserError(f"{key} with scheme.grad_compression={scheme.grad_compression}: the replicas exchange no"
                        " gradients every step to compress; set scheme.grad_compression=none")
    if memory_every:
        raise UserError(f"{key} with checkpoint.memory_every={memory_every}: the in-memory tier does not hold a"
                        " replica's own state yet; set checkpoint.memory_every=0")
    if sync.outer_lr <= 0:
        raise UserError(f"sync.outer_lr={sync.outer_lr}: expected a positive learning rate, like 0.7")
    if not 0 <= sync.outer_momentum < 1:
        raise UserError(f"sync.outer_momentum={sync.outer_momentum}: expected a value in [0, 1), like 0.9")
    if sync.dtype != SyncDtype.float32 and sync.mode == SyncMode.local_sgd:
        raise UserError(f"sync.dtype={sync.dtype} with +sync=local_sgd: the average would round the parameters"
                        " themselves; use sync.dtype=float32, or +sync=diloco (which sends deltas)")
    if sync.outer_nesterov and sync.outer_momentum == 0:
        raise UserError("sync.outer_nesterov=true needs sync.outer_momentum > 0; set sync.outer_nesterov=false")


def check_compression(scheme: SchemeConfig, degrees: Degrees) -> None:
    """scheme.grad_compression is a DDP communication hook: only where DDP all-reduces."""
    if scheme.powersgd_rank < 1:
        raise UserError(f"scheme.powersgd_rank={scheme.powersgd_rank}: expected a rank >= 1, like 2")
    if scheme.grad_compression == GradCompression.none or uses_ddp(scheme, degrees):
        return
    why = (f"scheme.data_parallel={scheme.data_parallel}" if scheme.data_parallel != DataParallel.ddp
           else f"one data-parallel rank (dp={degrees.dp}), nothing to all-reduce")
    raise UserError(
        f"scheme.grad_compression={scheme.grad_compression} compresses DDP's gradient all-reduce, and this scheme"
        f" has none ({why}); use +scheme=ddp on >= 2 workers, or scheme.grad_compression=none"
    )


def describe_sync(sync: SyncConfig | None, scheme: SchemeConfig) -> str:
    """The plan's line of how replicas synchronize."""
    if sync is None:
        every_step = "every step"
        if scheme.grad_compression != GradCompression.none:
            rank = f", rank {scheme.powersgd_rank}" if scheme.grad_compression == GradCompression.powersgd else ""
            every_step += f", gradients compressed: {scheme.grad_compression}{rank}"
        return every_step
    if sync.mode == "local_sgd":
        return f"local_sgd: replicas average their parameters every {sync.every} steps"
    nesterov = ", nesterov" if sync.outer_nesterov else ""
    sent = ", deltas sent in bfloat16" if sync.dtype == SyncDtype.bfloat16 else ""
    return (f"diloco: replicas average their deltas every {sync.every} steps, outer SGD lr {sync.outer_lr}"
            f" momentum {sync.outer_momentum}{nesterov}{sent}")
