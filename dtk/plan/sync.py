"""Plan-time checks of the ways replicas exchange less: synchronizing every `sync.every` steps
(`+sync=local_sgd|diloco`, dtk/train/sync.py) and compressing DDP's every-step gradient
all-reduce (`scheme.grad_compression`, dtk/parallel/compression.py). Pure, torch-free: a
mistake stops on the login node with one line.

And the weak-link advice (`weak_link`): when the replicas' exchange takes at least
EXCHANGE_DOMINATES of the job's predicted step (dtk.plan.cost.steptime), the plan names the
`sync.every` at which DiLoCo's exchange, spread over its steps, falls under EXCHANGE_TARGET
of the step, and each compression DDP can take with the share it leaves. A job already
under `+sync` gets its share, not the advice again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dtk.common.errors import UserError
from dtk.config.choices import DataParallel, GradCompression, SyncDtype, SyncMode
from dtk.config.schema import SchemeConfig, SyncConfig
from dtk.plan.cost.exchange import Exchange
from dtk.plan.cost.memory import Job, device_bytes
from dtk.plan.cost.steptime import Hardware, StepTime, step_time
from dtk.plan.degrees import Degrees
from dtk.plan.layout import uses_ddp
from dtk.plan.shape import ModelShape

EXCHANGE_DOMINATES = 0.5
"""Share of the predicted step the data-parallel exchange takes from which the plan advises exchanging less."""
EXCHANGE_TARGET = 0.10
"""Share of the step under which the advised sync.every brings the exchange (single digits of idle)."""
EVERY_CHOICES = (2, 4, 8, 16, 32, 64, 128, 250, 500, 1000, 2000, 4000, 8000)
"""sync.every values the advice picks from: the smallest that meets EXCHANGE_TARGET."""


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
    streamed = (f", streamed in {sync.fragments} fragments (one every {sync.every // sync.fragments} steps)"
                if sync.fragments > 1 else "")
    if sync.mode == "local_sgd":
        return f"local_sgd: replicas average their parameters every {sync.every} steps{streamed}"
    nesterov = ", nesterov" if sync.outer_nesterov else ""
    sent = ", deltas sent in bfloat16" if sync.dtype == SyncDtype.bfloat16 else ""
    return (f"diloco: replicas average their deltas every {sync.every} steps{streamed}, outer SGD lr"
            f" {sync.outer_lr} momentum {sync.outer_momentum}{nesterov}{sent}")


@dataclass(frozen=True)
class Option:
    """One way to exchange less, at the job's size."""

    kind: str
    """`diloco`, `bf16` or `powersgd`."""
    overrides: tuple[str, ...]
    step: StepTime
    share: float
    """The replicas' exchange as a share of that step."""
    extra_bytes: int
    """Device bytes it adds to the largest rank (the anchor and momentum of +sync)."""
    every: int = 0
    """diloco: the sync.every advised."""


@dataclass(frozen=True)
class WeakLink:
    """The replicas' exchange of the job as given, and what would shrink it."""

    step: StepTime
    exchange_s: float
    """Exposed seconds per step of the data-parallel axes (DATA_AXES)."""
    options: tuple[Option, ...]
    """Empty when the exchange does not dominate, or the job exchanges less already."""
    refused: str = ""
    """Why `+sync` is not among the options though the exchange dominates (check_sync's line)."""

    @property
    def share(self) -> float:
        return self.exchange_s / self.step.total_s


DATA_AXES = ("dp_replicate", "dp_shard")
"""The data-parallel exchange: the replicas' all-reduce, and FSDP's collectives (which +sync leaves inside a replica)."""


def exchange_s(t: StepTime) -> float:
    """The data-parallel axes' exposed seconds of a predicted step."""
    return sum(t.axes.get(a, 0.0) for a in DATA_AXES)


def exchange_share(t: StepTime) -> float:
    """The data-parallel exchange as a share of the predicted step."""
    return exchange_s(t) / t.total_s


def weak_link(shape: ModelShape, job: Job, *, global_batch: int, tasks_per_node: int,
              hw: Hardware) -> WeakLink | None:
    """The weak-link advice for `job` (module doc); None without a predicted step."""
    def timed(j: Job) -> StepTime:
        t = step_time(shape, j, global_batch=global_batch, tasks_per_node=tasks_per_node, hw=hw)
        assert t is not None  # the job's own step was predicted: the same model and batch
        return t

    t = step_time(shape, job, global_batch=global_batch, tasks_per_node=tasks_per_node, hw=hw)
    if t is None:
        return None
    advice = WeakLink(t, exchange_s(t), ())
    if job.sync.every or advice.share < EXCHANGE_DOMINATES:
        return advice
    base = device_bytes(shape, job).total
    options: list[Option] = []
    refused = ""
    try:
        options.append(_diloco(job, timed, base, lambda j: device_bytes(shape, j).total))
    except UserError as exc:
        refused = str(exc)
    if uses_ddp(job.scheme, job.degrees):
        for kind in (GradCompression.bf16, GradCompression.powersgd):
            if kind == job.scheme.grad_compression:
                continue
            compressed = dataclasses.replace(job, scheme=dataclasses.replace(job.scheme, grad_compression=kind))
            c = timed(compressed)
            options.append(Option(str(kind), (f"scheme.grad_compression={kind}",), c, exchange_share(c),
                                  device_bytes(shape, compressed).total - base))
    return dataclasses.replace(advice, options=tuple(options), refused=refused)


def _diloco(job: Job, timed, base: int, total_bytes) -> Option:
    """+sync=diloco at the smallest EVERY_CHOICES whose exchange is under EXCHANGE_TARGET of
    the step (the largest when none is). UserError when the job's scheme cannot take +sync."""
    overrides: tuple[str, ...] = ("+sync=diloco",)
    scheme = job.scheme
    if scheme.grad_compression != GradCompression.none:
        scheme = dataclasses.replace(scheme, grad_compression=GradCompression.none)
        overrides += ("scheme.grad_compression=none",)
    check_sync(SyncConfig(mode=SyncMode.diloco), scheme, job.degrees, memory_every=int(job.memory_snapshots))

    def at(every: int) -> Job:
        return dataclasses.replace(job, scheme=scheme, sync=Exchange.of(SyncConfig(mode=SyncMode.diloco, every=every)))

    once = timed(at(1))  # the whole exchange in every step: per sync, the same seconds
    per_sync = once.axes["dp_replicate"] if "dp_replicate" in once.axes else 0.0  # what sync.every divides
    rest = once.total_s - per_sync
    wanted = math.ceil(per_sync * (1 - EXCHANGE_TARGET) / (EXCHANGE_TARGET * rest)) if rest > 0 else EVERY_CHOICES[-1]
    every = next((h for h in EVERY_CHOICES if h >= wanted), EVERY_CHOICES[-1])
    t = timed(at(every))
    return Option("diloco", (*overrides, f"sync.every={every}"), t, exchange_share(t),
                  total_bytes(at(every)) - base, every)
