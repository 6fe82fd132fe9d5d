"""The predicted time of one optimizer step: compute, the communication that compute does
not hide, the pipeline bubble, and the host traffic of CPU offload. Pure arithmetic.

    step = compute + exposed communication + bubble + offload

- compute: the step's FLOPs on one device at the accelerator's dense peak x its efficiency
  at the job's GEMM width (dtk.plan.accelerators.WIDTH_SHARES, or the user's measured
  rates, `cluster.matmul_rates`).
  FLOPs per token are dtk's own count (dtk.train.flops: 6 per matmul weight and 12 x layers
  x hidden x seq_len for attention), plus one more forward (a third of it) per block under
  full activation checkpointing; selective checkpointing recomputes elementwise work only.
  Each device does world-size-th of the step's tokens.
- communication: the bytes each mesh axis moves per step and rank (dtk.plan.cost.comm) over its
  links: the intra-node figure when the axis stays inside a node, the inter-node one when
  it crosses nodes. Tensor-parallel and pipeline traffic is on the critical path; FSDP's
  all-gathers and reduce-scatters run ahead of / behind the blocks' compute and are exposed
  only where they exceed OVERLAP of it; context parallelism's key/value gathers (cp) and
  expert parallelism's token all-to-alls (ep) run inside the blocks, between the matmuls
  that need their results, and count whole (not overlapped); a once-per-step gradient all-reduce (DDP, HSDP's
  replicas) overlaps only the last micro-batch's backward; `+sync`'s parameter all-reduce
  every sync.every steps overlaps nothing (1/H of it per step).
- bubble: a pipeline of pp stages idles (pp - 1) / (virtual stages x micro-batches) of its
  compute (1F1B, GPipe; interleaved 1F1B divides by its virtual stages).
- offload: FSDP CPU offload copies the shards to the device for every gather and the
  gradients back (PCIe, not hidden), and runs AdamW on the host.

Bandwidths are the bus bandwidths nccl-tests reaches (GB/s per device, one direction),
first that applies: what `python -m dtk.doctor` measured on the cluster (`plan.doctor`,
its doctor.json), `cluster.intra_node_gbps` / `cluster.inter_node_gbps` (a site's cluster
file), else the accelerator's row in dtk.plan.accelerators. Across nodes the figure is one
network card's (one rank per node: the doctor's group across nodes); an axis whose groups
have several ranks on a node uses as many of the node's `cluster.nics_per_node` cards
(rails), shared by the node's groups (Speeds.across_nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dtk.plan.accelerators import gemm_width
from dtk.plan.cost.comm import fsdp_collectives, traffic
from dtk.plan.cost.memory import Job
from dtk.plan.layout import rank_layout, uses_fsdp
from dtk.plan.shape import ModelShape


@dataclass(frozen=True)
class Speeds:
    efficiency: float
    """Share of the dense peak that a large transformer's matmuls sustain in dtk's bf16 step."""
    intra_gbps: float
    """NVLink / NVSwitch bus bandwidth per device inside a node (GB/s)."""
    nic_gbps: float
    """Bus bandwidth through one network card (GB/s): what one rank per node reaches."""
    nics_per_node: int = 1
    """Network cards of a node (cluster.nics_per_node); the node's ranks share them."""
    host_gbps: float = 25.0
    """Host <-> device copies per device (PCIe)."""
    shares: tuple[tuple[int, float], ...] = ()
    """Measured (GEMM width, matmul rate at it / the widest's) of `python -m dtk.bench
    matmul` (cluster.matmul_rates), at width hidden / tp; replaces `curve`."""
    curve: tuple[tuple[int, float], ...] = ()
    """The default (GEMM width, share of the widest's rate): dtk.plan.accelerators.WIDTH_SHARES
    at gemm_width; empty: the efficiency is the same at every width."""

    def efficiency_at(self, width: int | None, gemm: float | None = None) -> float:
        """The efficiency of matmuls whose split dimension is `width` (hidden / tp) and whose
        gemm_width is `gemm`: the table's figure x the measured rate at `width` over the
        widest's where measured, else x the default curve at `gemm`; interpolated on log
        width, the ends held beyond the widths known."""
        if self.shares and width:
            return self.efficiency * _on_log_width(self.shares, width)
        if self.curve and gemm:
            return self.efficiency * _on_log_width(self.curve, gemm)
        return self.efficiency

    def across_nodes(self, ranks_per_node: int, tasks_per_node: int) -> float:
        """Bus bandwidth per rank of a collective whose groups cross nodes with
        `ranks_per_node` ranks of each group on a node. A group uses a card per rank it has
        on the node (its rail), up to the node's cards: a group spanning whole nodes uses
        every card, one with a rank per node one card. The node's groups of the axis run at
        the same time and share its cards (tasks_per_node / ranks_per_node of them), and no
        group goes faster than the links inside the node."""
        k = max(1, min(ranks_per_node, tasks_per_node))
        own = min(k, self.nics_per_node) * self.nic_gbps
        shared = self.nics_per_node * self.nic_gbps * k / max(tasks_per_node, 1)
        return min(own, shared, self.intra_gbps)


def _on_log_width(points: tuple[tuple[int, float], ...], width: float) -> float:
    ordered = sorted(points)
    if width <= ordered[0][0]:
        return ordered[0][1]
    for (w0, s0), (w1, s1) in zip(ordered, ordered[1:], strict=False):
        if width <= w1:
            return s0 + math.log(width / w0) / math.log(w1 / w0) * (s1 - s0)
    return ordered[-1][1]


OVERLAP = 0.9
"""Share of the compute FSDP's prefetched collectives can hide behind."""
HOST_OPTIMIZER_GBPS = 10.0
"""Bytes per second one worker's host AdamW step streams (parameters, gradients, two moments)."""


@dataclass(frozen=True)
class Hardware:
    peak_tflops: float
    """Dense peak of one device in the matmul dtype."""
    speeds: Speeds
    source: str


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float
    """Exposed communication."""
    bubble_s: float
    offload_s: float
    tokens: int
    model_flops: float
    """The step's model FLOPs (no recompute), for MFU."""
    world: int
    peak_tflops: float
    axes: dict[str, float]
    """Exposed seconds per mesh axis."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.bubble_s + self.offload_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s

    @property
    def mfu(self) -> float:
        return self.model_flops / self.total_s / (self.world * self.peak_tflops * 1e12)

    def to_json(self) -> dict[str, Any]:
        return {
            "predicted_step_s": round(self.total_s, 4), "compute_s": round(self.compute_s, 4),
            "comm_s": round(self.comm_s, 4), "bubble_s": round(self.bubble_s, 4),
            "offload_s": round(self.offload_s, 4), "tokens_per_s": round(self.tokens_per_s, 1),
            "mfu": round(self.mfu, 4), "exposed_by_axis": {k: round(v, 4) for k, v in self.axes.items()},
        }

    def describe(self) -> str:
        parts = f"compute {self.compute_s:.3g} s + communication {self.comm_s:.3g} s"
        if self.bubble_s:
            parts += f" + bubble {self.bubble_s:.3g} s"
        if self.offload_s:
            parts += f" + CPU offload {self.offload_s:.3g} s"
        return (f"{self.total_s:.3g} s per step ({parts}), {self.tokens_per_s:,.0f} tokens/s,"
                f" MFU {self.mfu:.0%}")


def flops_per_token(shape: ModelShape, activation_checkpoint: str) -> tuple[float, float] | None:
    """(model, hardware) FLOPs per token of one forward and backward; None without a
    sequence length. Hardware FLOPs add full checkpointing's second forward of the blocks."""
    if not shape.seq_len:
        return None
    # A mixture of experts' weights count for the share a token computes with (top_k / experts).
    matmul = sum(t.numel * t.active for t in shape.tensors if t.matmul)
    block = sum(t.numel * t.active for t in shape.tensors if t.matmul and t.block)
    attention = 12 * (shape.layers or 0) * (shape.hidden or 0) * shape.seq_len
    model = 6.0 * matmul + attention
    extra = (2.0 * block + attention / 3) if activation_checkpoint == "full" else 0.0
    return model, model + extra


def step_time(shape: ModelShape, job: Job, *, global_batch: int, tasks_per_node: int, hw: Hardware) -> StepTime | None:
    """The predicted step of `job`; None when the model has no sequence length to count tokens by."""
    flops = flops_per_token(shape, str(job.scheme.activation_checkpoint))
    if flops is None:
        return None
    model_fpt, hw_fpt = flops
    d, sp = job.degrees, hw.speeds
    assert shape.seq_len is not None  # flops_per_token counted by it
    tokens = global_batch * shape.seq_len
    width = shape.hidden // d.tp if shape.hidden else None  # the split dimension of each rank's matmuls
    gemm = gemm_width(shape.hidden, shape.ffn_hidden or 4 * shape.hidden, d.tp) if shape.hidden else None
    compute = tokens * hw_fpt / d.world / (hw.peak_tflops * 1e12 * sp.efficiency_at(width, gemm))
    axes: dict[str, float] = {}
    replicate_window = compute * 2 / 3 / job.num_micro  # the last micro-batch's backward
    for a in traffic(shape, job, tasks_per_node):
        gbps = sp.across_nodes(a.ranks_per_node, tasks_per_node) if a.crosses_nodes else sp.intra_gbps
        seconds = a.bytes_per_step / (gbps * 1e9)
        if a.axis == "dp_shard":
            seconds = max(0.0, seconds - OVERLAP * compute)
        elif a.axis == "dp_replicate" and not job.sync.every:  # +sync's exchange waits on nothing to hide behind
            seconds = max(0.0, seconds - replicate_window)
        axes[a.axis] = seconds
    comm = sum(axes.values())
    bubble = 0.0
    if d.pp > 1:
        virtual = job.scheme.pp_virtual_stages
        bubble = (compute + (axes["tp"] if "tp" in axes else 0.0)) * (d.pp - 1) / (virtual * job.num_micro)
    offload = 0.0
    if job.scheme.cpu_offload and uses_fsdp(job.scheme, d) and job.device == "cuda":
        layout = rank_layout(shape, job.scheme, d, 0, job.split_points)
        shard = sum(h.numel for h in layout.held)
        p = job.precision
        gathers, reduces, _ = fsdp_collectives(job.scheme, d, job.num_micro)  # each copies the shard across
        copies = shard * (gathers * p.param_bytes + reduces * p.grad_bytes)
        states = shard * (p.param_bytes + p.grad_bytes + p.optimizer_bytes) * 2  # read and write back
        offload = copies / (sp.host_gbps * 1e9) + states / (HOST_OPTIMIZER_GBPS * 1e9)
    return StepTime(compute, comm, bubble, offload, tokens, tokens * model_fpt, d.world, hw.peak_tflops, axes)


def doctor_links(path: str) -> tuple[float | None, float | None]:
    """(inside a node, across nodes) bus bandwidth in GB/s from `python -m dtk.doctor`'s
    doctor.json (the file or its folder): each group's figure at its largest message, the
    median over the nodes' own groups (one node: the world's). UserError when unreadable."""
    import json
    import statistics
    from pathlib import Path

    from dtk.common.errors import UserError

    file = Path(path).expanduser()
    file = file / "doctor.json" if file.is_dir() else file
    try:
        groups = json.loads(file.read_text())["groups"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"plan.doctor={path}: not a doctor.json of python -m dtk.doctor ({type(exc).__name__});"
                        " give the folder the doctor wrote, or its doctor.json") from None

    def largest(g: dict) -> float | None:
        rows = [r for r in g.get("rows") or [] if r.get("busbw_gbs")]
        return max(rows, key=lambda r: r["size_mb"])["busbw_gbs"] if rows else None

    inside = [b for g in groups if str(g.get("group", "")).startswith("inside ") and (b := largest(g))]
    across = [b for g in groups if str(g.get("group", "")).startswith("across nodes") and (b := largest(g))]
    if not inside and not across:  # one node: the world is the node
        inside = [b for g in groups if g.get("group") == "world" and (b := largest(g))]
    return (statistics.median(inside) if inside else None), (statistics.median(across) if across else None)


def matmul_shares(path: str) -> tuple[tuple[int, float], ...]:
    """(width, share) from `python -m dtk.bench matmul`'s files (one, or a folder of
    matmul-*.json, one per node): at each width the slowest node's rate over the fastest
    node's rate at its widest width, so a slow node lowers every width. UserError when
    unreadable."""
    import json
    from pathlib import Path

    from dtk.common.errors import UserError

    where = Path(path).expanduser()
    files = sorted(where.glob("matmul-*.json")) if where.is_dir() else [where]
    try:
        runs = [{int(r["width"]): float(r["tflops"]) for r in json.loads(f.read_text())["rows"]} for f in files]
        if not runs or not all(runs) or any(v <= 0 for run in runs for v in run.values()):
            raise ValueError("no rates")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cluster.matmul_rates={path}: not the output of python -m dtk.bench matmul"
                        f" ({type(exc).__name__}); give its --out folder or one of its matmul-HOST.json") from None
    widths = sorted(set.intersection(*(set(run) for run in runs)))
    if not widths:
        raise UserError(f"cluster.matmul_rates={path}: its files measured no width in common; measure them again")
    best = max(run[widths[-1]] for run in runs)
    return tuple((w, min(run[w] for run in runs) / best) for w in widths)


def hardware_of(cluster, *, device: str, param_dtype: str, doctor: str | None = None) -> Hardware | None:
    """The device's peak and links from the cluster section (`cfg.cluster`); None on the CPU
    or for a GPU whose peak is unknown (no accelerator named, no cluster.peak_tflops).
    Links, first that applies: the doctor's measured figures (`plan.doctor`), the cluster's
    `intra_node_gbps` / `inter_node_gbps`, the accelerator's row of the table; across nodes
    per network card, `cluster.nics_per_node` of them."""
    from dtk.plan.accelerators import GENERIC, WIDTH_SHARES, lookup

    if device != "cuda" or not (cluster.peak_tflops or cluster.accelerator):
        return None
    acc = lookup(cluster.accelerator) if cluster.accelerator else None
    dtype = "tf32" if param_dtype == "float32" else "bfloat16"
    if cluster.peak_tflops:
        peak = cluster.peak_tflops
    else:
        assert acc is not None  # an accelerator is named when no peak is (checked above)
        peak = acc.peak_tflops(dtype)
    base = acc or GENERIC
    intra, inter = doctor_links(doctor) if doctor else (None, None)
    source = (f"{acc.name if acc else 'cluster.peak_tflops'} ({peak:g} TFLOP/s dense {dtype} x {base.efficiency:g}"
              " at wide GEMMs)")
    if intra or inter:
        source += f", links measured by dtk.doctor ({doctor})"
    nics = cluster.nics_per_node
    source += f", {nics} network card(s) per node"
    shares = matmul_shares(cluster.matmul_rates) if cluster.matmul_rates else ()
    if shares:
        source += f", matmul rate by width measured by dtk.bench ({cluster.matmul_rates})"
    speeds = Speeds(base.efficiency, intra or cluster.intra_node_gbps or base.nvlink_gbps,
                    inter or cluster.inter_node_gbps or base.nic_gbps, nics, base.host_gbps, shares, WIDTH_SHARES)
    return Hardware(peak, speeds, source)
