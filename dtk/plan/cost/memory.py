"""Per-device memory of a training job under one scheme at one size: pure arithmetic.

    total = params + grads + optimizer + activations + buffers + margin

- params, grads, optimizer: the bytes of the tensors a rank holds between steps, from
  dtk.plan.layout (which elements) x bytes per element. dtk keeps fp32 parameters and
  gradients (4 + 4 bytes) and AdamW's two fp32 moments (8 bytes) per parameter, plus a
  4-byte step counter per tensor. `plan.param_bytes`, `plan.grad_bytes` and
  `plan.optimizer_bytes` replace these to follow another framework's accounting (the
  ZeRO paper's 2 + 2 + 12).
- activations: dtk.plan.cost.activations (kept for backward at the peak, plus backward's
  working set).
- buffers: FSDP's gathered parameters (in the compute dtype: the root unit and the last
  block stay gathered, two blocks in flight; with reshard_after_forward=false every unit
  stays gathered from its forward to its backward) and its reduce-scatter input (one
  block's unsharded gradient). Under a pipeline (pp > 1) torch's schedule reshards a stage
  and reduce-scatters its gradients once, at the step's end: the whole stage's gathered
  parameters and its unsharded gradients (accumulated in the reduce dtype, in place of the
  sharded ones: their excess over `grads`) are resident at the peak, whatever
  reshard_after_forward says (dtk.plan.layout.reshards_after_forward keeps them gathered
  through the step by default there). Autocast's low-precision weight copies under DDP;
  pipeline receive buffers; the staged checkpoint copy when the device is the CPU. DDP's gradient
  buckets cost nothing extra: dtk's gradients are views into them. What exchanging less
  keeps (dtk.plan.cost.exchange): +sync's anchor and diloco's outer momentum (each a copy of the
  rank's parameters) and the copies a synchronization makes; PowerSGD's error feedback and
  P and Q matrices.
- margin: FRAGMENTATION of the rest for the caching allocator, plus a fixed runtime
  allowance per process (CUDA context, NCCL and cuBLAS workspaces; on the CPU the Python
  interpreter with torch loaded).

The device figure is the largest rank's. Host memory (the async checkpoint's staged copy
of a GPU job, CPU-offloaded states) is reported apart.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from dtk.config.schema import SchemeConfig
from dtk.plan.cost.activations import Activations, Dims, in_flight, rank_activations, recv_buffer_bytes
from dtk.plan.cost.exchange import SYNC_KEYS, Exchange, exchange_state
from dtk.plan.degrees import Degrees
from dtk.plan.layout import (
    RankLayout,
    coords,
    rank_layout,
    rank_of,
    reshards_after_forward,
    tied_copy_numel,
    uses_fsdp,
    uses_zero1,
    zero1_owner,
)
from dtk.plan.shape import ModelShape

FRAGMENTATION = 0.10
"""Share added for allocator fragmentation and short-lived temporaries."""
RUNTIME_BYTES = {"cuda": 1_000_000_000, "cpu": 400_000_000}
"""Per process: CUDA context + NCCL + cuBLAS workspaces on a GPU; interpreter + torch on the CPU."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state."""

    param_bytes: float = 4
    grad_bytes: float = 4
    optimizer_bytes: float = 8
    step_bytes: int = 4
    """AdamW's step counter, one fp32 scalar per parameter tensor (0 in another framework's accounting)."""
    compute_bytes: int = 4
    """Activations (the forward dtype)."""
    gathered_bytes: float = 4
    """FSDP's gathered parameters and autocast's weight copies."""
    reduce_bytes: int = 4
    """FSDP's gradient reduce-scatter dtype."""


@functools.cache
def _scheme_types() -> dict[str, Any]:
    return typing.get_type_hints(SchemeConfig)


def scheme_config(raw: Mapping[str, Any]) -> SchemeConfig:
    """A scheme variant (the schema's keys as the scheme yaml files and the job give them,
    dtk.plan.cost.variants) as the typed config the budget reads; a closed set's value becomes
    its Enum member. Plain construction, not OmegaConf: the search builds thousands."""
    types = _scheme_types()
    values = {}
    for f in dataclasses.fields(SchemeConfig):
        if f.name in raw:
            value, kind = raw[f.name], types[f.name]
            is_choice = isinstance(kind, type) and issubclass(kind, Enum)
            values[f.name] = kind(value) if is_choice and value is not None else value
    return SchemeConfig(**values)


def precision_for(scheme: SchemeConfig, device: str, plan: dict[str, Any] | None = None) -> Precision:
    """dtk's accounting for `scheme` on `device` (`cuda` or `cpu`), with plan.* overrides."""
    auto = "bfloat16" if device == "cuda" else "float32"
    param_dtype = auto if scheme.param_dtype == "auto" else str(scheme.param_dtype)
    reduce_dtype = "float32" if scheme.reduce_dtype == "auto" else str(scheme.reduce_dtype)
    compute = DTYPE_BYTES[param_dtype]
    plan = plan or {}
    given = {k: plan.get(k) for k in ("param_bytes", "grad_bytes", "optimizer_bytes") if plan.get(k) is not None}
    base = Precision(compute_bytes=compute, gathered_bytes=compute, reduce_bytes=DTYPE_BYTES[reduce_dtype])
    if not given:
        return base
    # Another framework's accounting: its parameter bytes are the copy compute uses (its
    # fp32 master copy, if any, is part of its optimizer bytes); no per-tensor extras.
    counted = {**{k: getattr(base, k) for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}, **given}
    return Precision(
        **counted,
        step_bytes=0,
        compute_bytes=compute,
        gathered_bytes=counted["param_bytes"] if "param_bytes" in given else compute,
        reduce_bytes=base.reduce_bytes,
    )


@dataclass(frozen=True)
class Job:
    """One scheme at one size: everything the estimate depends on besides the model."""

    scheme: SchemeConfig
    degrees: Degrees
    micro_batch: int
    num_micro: int
    """Micro-batches per optimizer step (accumulation, or the pipeline's micro-batches)."""
    device: str
    precision: Precision
    async_checkpoint: bool = True
    memory_snapshots: bool = False
    """checkpoint.memory_every > 0: own shard and a partner's replica of params + optimizer, two steps kept, in host memory."""
    split_points: tuple[str, ...] = ()
    sync: Exchange = Exchange()
    """How the replicas exchange (+sync; the default: every step)."""


@dataclass
class RankBytes:
    """One rank's bytes by kind."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    margin: int
    host: int
    detail: dict[str, int] = field(default_factory=dict)
    activations_saved: int = 0
    model_states: int = 0
    """params + grads + optimizer + parameters gathered for the whole step (ZeRO-2): the ZeRO paper's figure."""
    gathered_kept: int = 0
    """FSDP's gathered parameters of every unit, held at the step's peak (`keeps_gathered`); 0 otherwise."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.margin

    def as_dict(self) -> dict[str, int]:
        return {
            "params": self.params, "grads": self.grads, "optimizer": self.optimizer,
            "activations": self.activations, "buffers": self.buffers, "margin": self.margin, "total": self.total,
        }


def job_dims(shape: ModelShape, job: Job) -> Dims | None:
    seq, hidden = shape.seq_len, shape.hidden
    if not shape.has_activation_shape or seq is None or hidden is None:
        return None
    return Dims(  # a context-parallel rank holds seq_len / cp tokens of each sample
        b=job.micro_batch, s=seq // job.degrees.cp, h=hidden, f=shape.ffn_hidden or 4 * hidden,
        heads=shape.heads or 0, vocab=shape.vocab or 0, a=job.precision.compute_bytes, tp=job.degrees.tp,
        sp=job.scheme.sequence_parallel and job.degrees.tp > 1, fused_norm=job.device == "cuda", cp=job.degrees.cp,
    )


def _activations(shape: ModelShape, job: Job, layout: RankLayout, pp_index: int) -> Activations:
    dims = job_dims(shape, job)
    if dims is None:
        return Activations(0, 0)
    d = job.degrees
    blocks_per_part = [
        sum(1 for unit, is_block in shape.units if is_block and unit in units)
        for units in _part_units(shape, layout)
    ]
    return rank_activations(
        shape, dims, job.scheme.activation_checkpoint, blocks_per_part=blocks_per_part,
        first=0 in layout.stage_ids, last=layout.num_stages - 1 in layout.stage_ids,
        schedule=job.scheme.pp_schedule, pp=d.pp, pp_index=pp_index, num_micro=job.num_micro,
        virtual=len(layout.stage_ids),
    )


def _part_units(shape: ModelShape, layout: RankLayout) -> list[set[str]]:
    parts: list[set[str]] = [set() for _ in layout.stage_ids]
    for h in layout.held:
        parts[h.part].add(h.tensor.unit)
    return parts


def rank_bytes(shape: ModelShape, job: Job, rank: int) -> RankBytes:
    """The bytes of one rank, every kind."""
    p, d = job.precision, job.degrees
    layout = rank_layout(shape, job.scheme, d, rank, job.split_points)
    params = round(sum(h.numel for h in layout.held) * p.param_bytes)
    grads = round(sum(h.grad_numel for h in layout.held) * p.grad_bytes)
    optimizer = round(layout.optimizer_numel * p.optimizer_bytes) + p.step_bytes * layout.optimizer_tensors
    copy = tied_copy_numel(shape, job.scheme, d, layout)  # the last stage's own copy of a tied weight
    params, grads = params + round(copy * p.param_bytes), grads + round(copy * p.grad_bytes)
    if copy:  # its optimizer state (ZeRO-1: a 1/dp share, on average)
        optimizer += round(copy * p.optimizer_bytes / (d.dp if uses_zero1(job.scheme, d) else 1)) + p.step_bytes
    acts = _activations(shape, job, layout, coords(rank, d).pp)
    detail: dict[str, int] = {}
    gathered_whole_step = 0
    if uses_fsdp(job.scheme, d):
        units: dict[str, int] = {}
        for h in layout.held:
            units[h.tensor.unit] = units.get(h.tensor.unit, 0) + h.unsharded_numel
        blocks = sorted((n for u, n in units.items() if _is_block(shape, u)), reverse=True)
        root = sum(n for u, n in units.items() if not _is_block(shape, u))
        if keeps_gathered(job.scheme, d):
            gathered_whole_step = round((root + sum(blocks)) * p.gathered_bytes)
            detail["fsdp_gather"] = gathered_whole_step
        elif shape.layers:
            # the root stays gathered (fully_shard keeps the root), dtk keeps the last block, two in flight
            detail["fsdp_gather"] = round((root + sum(blocks[:3])) * p.gathered_bytes)
        else:
            detail["fsdp_gather"] = 0  # per-layer sizes unknown (what-if without plan.layers)
        if shape.layers and blocks:
            # one block's unsharded gradient, and its copy in the reduce dtype when that differs
            extra = p.reduce_bytes if p.reduce_bytes != p.compute_bytes else 0
            detail["fsdp_reduce_scatter"] = round(blocks[0] * (p.compute_bytes + extra))
        if d.pp > 1:
            # the pipeline defers the reduce-scatter to the step's end: the stage's gradients
            # accumulate unsharded, in the reduce dtype (FSDP's unsharded_accumulated_grad),
            # while the sharded ones (`grads`) do not exist (zero_grad set them to None); at
            # the end each unit's shard replaces its unsharded gradient. The excess over `grads`:
            detail["fsdp_unsharded_grads"] = max(0, round((root + sum(blocks)) * p.reduce_bytes) - grads)
    elif p.gathered_bytes < p.param_bytes:
        # autocast keeps a low-precision copy of every matmul weight for the step
        detail["autocast_weights"] = round(sum(h.numel for h in layout.held if h.tensor.matmul) * p.compute_bytes)
    detail.update(exchange_state(job, layout, freed=grads + acts.total, param_bytes=p.param_bytes,
                                 grad_bytes=p.grad_bytes))
    dims = job_dims(shape, job)
    if d.pp > 1 and dims is not None:
        per = p.compute_bytes * dims.bsh // (d.tp if dims.sp else 1)
        first, last = 0 in layout.stage_ids, layout.num_stages - 1 in layout.stage_ids
        stages = len(layout.stage_ids)
        chunks = in_flight(job.scheme.pp_schedule, pp=d.pp, pp_index=coords(rank, d).pp, num_micro=job.num_micro,
                           virtual=stages)
        detail["pipeline_recv"] = recv_buffer_bytes(per, chunks=chunks, stages=stages, first=first, last=last,
                                                    num_micro=job.num_micro)
    kept = detail.get("sync_anchor", 0) + detail.get("sync_outer_momentum", 0)  # the checkpoint holds them too
    staged = params + optimizer + kept if job.async_checkpoint else 0
    offload = job.scheme.cpu_offload and uses_fsdp(job.scheme, d) and job.device == "cuda"
    host = staged if job.device == "cuda" else 0
    if job.device == "cpu" and staged:
        detail["checkpoint_staging"] = staged
    tier = 4 * (params + optimizer) if job.memory_snapshots else 0  # (own + replica) x the two newest steps
    if job.device == "cpu" and tier:
        detail["memory_tier"] = tier
    host += tier if job.device == "cuda" else 0
    if offload:  # the synchronizer's copies follow the parameters to the host
        host += params + grads + optimizer + sum(detail.pop(k, 0) for k in SYNC_KEYS)
        params = grads = optimizer = 0
    buffers = sum(detail.values())
    model_states = params + grads + optimizer + gathered_whole_step
    subtotal = params + grads + optimizer + acts.total + buffers
    margin = round(FRAGMENTATION * subtotal) + RUNTIME_BYTES[job.device]
    return RankBytes(
        rank=rank, params=params, grads=grads, optimizer=optimizer, activations=acts.total, buffers=buffers,
        margin=margin, host=host, detail=detail, activations_saved=acts.saved, model_states=model_states,
        gathered_kept=gathered_whole_step,
    )


def keeps_gathered(scheme: SchemeConfig, d: Degrees) -> bool:
    """Whether every FSDP unit's gathered parameters are resident at the step's peak: with
    reshard_after_forward off (the rule's answer), and under any pipeline, whose backward
    leaves each unit gathered until the step's end (torch's pipelining turns FSDP's reshard
    after backward off for all but the last)."""
    return not reshards_after_forward(scheme, d) or d.pp > 1


def _is_block(shape: ModelShape, unit: str) -> bool:
    return unit in shape.block_units


def representative_ranks(shape: ModelShape, job: Job) -> list[int]:
    """Ranks that can be the largest: every pipeline index (stages differ) and, under ZeRO-1,
    the data-parallel index with the largest share; index 0 elsewhere (torch.chunk's first
    pieces are the largest)."""
    d = job.degrees
    ranks = []
    dp_indices = [0]
    if uses_zero1(job.scheme, d):
        numels = tuple(t.numel for t in shape.tensors)
        load = [0] * d.dp
        for n, owner in zip(numels, zero1_owner(numels, d.dp), strict=True):
            load[owner] += n
        dp_indices = sorted({0, max(range(d.dp), key=lambda r: load[r])})
    first = coords(0, d)
    for dp_index in dp_indices:
        rep, shard = divmod(dp_index, d.dp_shard)
        for pp_index in range(d.pp):
            at = dataclasses.replace(first, dp_replicate=rep, pp=pp_index, dp_shard=shard)
            ranks.append(rank_of(at, d))
    return ranks


def device_bytes(shape: ModelShape, job: Job) -> RankBytes:
    """The largest rank's bytes: what has to fit on every device."""
    return max((rank_bytes(shape, job, r) for r in representative_ranks(shape, job)), key=lambda b: b.total)
