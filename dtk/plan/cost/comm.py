"""Where the ranks sit and what travels between them: rank -> node placement, the groups
of each mesh axis, and bytes per step per axis. Pure arithmetic, no torch.

The mesh is `arange(world).view(dp_replicate, pp, dp_shard, tp)` (dtk.mesh.mesh) and a
rank's node is `rank // tasks_per_node` (Slurm's block distribution, and the local order).

Bytes per step are what one rank sends on the axis, with ring algorithms (nccl-tests'
convention): an all-reduce of B bytes over n ranks sends 2 (n-1)/n B, an all-gather or a
reduce-scatter of a B-byte whole (n-1)/n B; a pipeline stage sends each micro-batch's
activation forward and its gradient back. The replicas' exchange follows the run's way of
exchanging less (dtk.plan.sync): `+sync` all-reduces the parameters (diloco: their deltas,
in bfloat16 with sync.dtype=bfloat16) once per sync.every steps (counted per step: 1/H of it); scheme.grad_compression sends DDP's
gradients in bfloat16 (2 bytes each), or PowerSGD's P and Q of each matrix that shrinks
2x at its rank ((n + m) x r elements instead of n x m; its 10 warm-up steps not counted;
a what-if model, which has no matrix shapes, is counted uncompressed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtk.config.choices import ActivationCheckpoint, GradCompression
from dtk.config.schema import SchemeConfig
from dtk.plan.cost.memory import Job, job_dims
from dtk.plan.degrees import Axis, Degrees
from dtk.plan.layout import Held, axis_groups, coords, rank_layout, reshards_after_forward, uses_fsdp, uses_zero1
from dtk.plan.shape import ModelShape

AXES = Axis.values()  # the grid's order, outermost first
# Link speeds assumed to name the bottleneck (GB/s per device, one direction): NVLink 4
# inside a node, one 400 Gb/s NIC per GPU across nodes. Only their ratio matters here.
INTRA_NODE_GBPS = 450.0
INTER_NODE_GBPS = 50.0


def node_of(rank: int, tasks_per_node: int) -> int:
    return rank // tasks_per_node


def crosses_nodes(d: Degrees, axis: str, tasks_per_node: int) -> bool:
    """Whether some group of the axis spans more than one node."""
    return any(
        len({node_of(r, tasks_per_node) for r in group}) > 1 for group in axis_groups(d, axis)
    )


def ranks_per_node(d: Degrees, axis: str, tasks_per_node: int) -> int:
    """Ranks of rank 0's group of the axis on one node (the fewest over the group's nodes):
    how many network cards (rails) the group can use when it crosses nodes."""
    group = next(g for g in axis_groups(d, axis) if 0 in g)
    counts: dict[int, int] = {}
    for r in group:
        counts[node_of(r, tasks_per_node)] = counts.get(node_of(r, tasks_per_node), 0) + 1
    return min(counts.values())


@dataclass(frozen=True)
class AxisTraffic:
    axis: str
    size: int
    bytes_per_step: int
    what: str
    crosses_nodes: bool
    ranks_per_node: int = 1
    """Ranks of one group on a node (comm.ranks_per_node)."""

    @property
    def seconds_estimate(self) -> float:
        """At the assumed link speed (INTRA_NODE_GBPS / INTER_NODE_GBPS): for ranking, not a promise."""
        gbps = INTER_NODE_GBPS if self.crosses_nodes else INTRA_NODE_GBPS
        return self.bytes_per_step / (gbps * 1e9)


def _ring(n: int) -> float:
    return (n - 1) / n


def fsdp_collectives(scheme: SchemeConfig, d: Degrees, num_micro: int) -> tuple[int, int, str]:
    """(all-gathers, reduce-scatters) of each FSDP unit per optimizer step, and in words.
    Without a pipeline each micro-batch gathers in forward, again in backward when the unit
    reshards after forward, and reduce-scatters its gradient. A pipeline step (pp > 1) keeps
    the stage gathered through all its micro-batches by default (one all-gather), and torch's
    schedule reduce-scatters once, at the step's end; resharding after forward there gathers
    in every micro-batch's forward and backward (an upper bound: 1F1B's forward right after
    a backward finds the unit still gathered)."""
    resharding = reshards_after_forward(scheme, d)
    if d.pp > 1:
        if not resharding:
            return 1, 1, "FSDP all-gather + reduce-scatter once per pipeline step"
        return 2 * num_micro, 1, f"FSDP all-gather x2 per micro-batch ({num_micro}) + reduce-scatter once per step"
    gathers = 2 if resharding else 1  # forward, and again for backward
    return (gathers * num_micro, num_micro,
            f"FSDP all-gather x{gathers} + reduce-scatter per micro-batch ({num_micro})")


def traffic(shape: ModelShape, job: Job, tasks_per_node: int) -> list[AxisTraffic]:
    """Bytes per step per axis for rank 0 (the first pipeline stage, the largest shard)."""
    d, p, scheme = job.degrees, job.precision, job.scheme
    layout = rank_layout(shape, scheme, d, 0, job.split_points)
    unsharded = sum(h.unsharded_numel for h in layout.held)  # tensor-parallel local, this stage
    dims = job_dims(shape, job)
    out: list[AxisTraffic] = []

    def add(axis: str, size: int, nbytes: float, what: str) -> None:
        if size > 1:
            out.append(AxisTraffic(axis, size, round(nbytes), what, crosses_nodes(d, axis, tasks_per_node),
                                   ranks_per_node(d, axis, tasks_per_node)))

    if uses_fsdp(scheme, d):
        gathers, reduces, what = fsdp_collectives(scheme, d, job.num_micro)
        nbytes = _ring(d.dp_shard) * unsharded * (gathers * p.gathered_bytes + reduces * p.reduce_bytes)
        add("dp_shard", d.dp_shard, nbytes, what)
        shard = unsharded / d.dp_shard
        if job.sync.every:
            add("dp_replicate", d.dp_replicate,
                2 * _ring(d.dp_replicate) * shard * job.sync.element_bytes / job.sync.every,
                f"+sync: parameter all-reduce of the shards every {job.sync.every} steps")
        else:
            add("dp_replicate", d.dp_replicate, 2 * _ring(d.dp_replicate) * shard * p.reduce_bytes,
                "HSDP gradient all-reduce of the shards, once per step")
    elif d.dp > 1 and job.sync.every:
        add("dp_replicate", d.dp, 2 * _ring(d.dp) * unsharded * job.sync.element_bytes / job.sync.every,
            f"+sync: parameter all-reduce every {job.sync.every} steps")
    elif d.dp > 1:
        grads, what = compressed_gradients(layout.held, scheme, p.grad_bytes)
        nbytes = 2 * _ring(d.dp) * grads
        if uses_zero1(scheme, d):
            nbytes += _ring(d.dp) * unsharded * p.param_bytes
            what += " + ZeRO-1 parameter broadcast"
        add("dp_replicate", d.dp, nbytes, what)
    if dims is not None and d.tp > 1:
        blocks = len({h.tensor.unit for h in layout.held if h.tensor.block})
        forward_passes = 2 if scheme.activation_checkpoint != ActivationCheckpoint.none else 1  # recompute repeats them
        # two all-reduces (or all-gather + reduce-scatter pairs) of a bsh activation per block
        # in each forward, two in backward
        per_block = (2 * forward_passes + 2) * 2 * _ring(d.tp) * dims.bsh * dims.a
        add("tp", d.tp, job.num_micro * blocks * per_block, "tensor-parallel collectives inside every block")
    if dims is not None and d.cp > 1:
        blocks = len({h.tensor.unit for h in layout.held if h.tensor.block})
        gathers = 2 if scheme.activation_checkpoint == ActivationCheckpoint.full else 1  # the recompute gathers again
        # keys and values of the whole sequence (cp x this rank's tokens): all-gathered in
        # forward, their gradients reduce-scattered in backward; dtk.parallel.cp issues them
        # inside the block, so they are not overlapped with compute (the step time counts them whole)
        per_block = (gathers + 1) * _ring(d.cp) * 2 * d.cp * dims.bsh * dims.a / d.tp
        add("cp", d.cp, job.num_micro * blocks * per_block,
            "context-parallel all-gather of keys and values per block and micro-batch (again in a full-checkpoint"
            " recompute) + reduce-scatter of their gradients; not overlapped with compute")
    if dims is not None and d.ep > 1:
        experts = [t for t in shape.tensors if t.expert]
        blocks = len({t.unit for t in experts})
        top_k = round(sum(t.active * t.shape[0] for t in experts[:1]))  # active share x experts
        forward_passes = 2 if scheme.activation_checkpoint == ActivationCheckpoint.full else 1
        # each token to its top_k experts and back (two all-to-alls) in every forward, the
        # gradients the same way in backward; an even routing leaves (ep-1)/ep of it this rank
        per_block = (2 * forward_passes + 2) * _ring(d.ep) * top_k * dims.bsh * dims.a
        add("ep", d.ep, job.num_micro * blocks * per_block,
            "expert-parallel all-to-all of routed tokens to their experts and back per MoE block and micro-batch"
            " (forward and backward; again in a full-checkpoint recompute); not overlapped with compute")
    if dims is not None and d.pp > 1:
        chunks = len(layout.stage_ids)
        add("pp", d.pp, job.num_micro * chunks * 2 * dims.bsh * dims.a / (d.tp if dims.sp else 1),
            "activations forward and gradients back, per micro-batch")
    return out


def compressed_gradients(held: tuple[Held, ...], scheme: SchemeConfig, grad_bytes: float) -> tuple[float, str]:
    """Bytes DDP's all-reduce sends of one replica's gradients under scheme.grad_compression, and in words."""
    elements = sum(h.unsharded_numel for h in held)
    if scheme.grad_compression == GradCompression.bf16:
        return elements * 2, "DDP gradient all-reduce in bfloat16, once per step"
    if scheme.grad_compression == GradCompression.powersgd:
        sent = 0
        for h in held:
            shape = h.tensor.shape
            n = shape[0] if shape else 1
            m = h.unsharded_numel // max(n, 1)
            r = min(n, m, scheme.powersgd_rank)
            sent += (n + m) * r if len(shape) > 1 and 2 * (n + m) * r < n * m else h.unsharded_numel
        return sent * grad_bytes, f"DDP PowerSGD all-reduce (rank {scheme.powersgd_rank}), once per step"
    return elements * grad_bytes, "DDP gradient all-reduce, once per step"


def bottleneck(axes: list[AxisTraffic]) -> AxisTraffic | None:
    """The axis that takes longest at the assumed link speeds."""
    return max(axes, key=lambda a: a.seconds_estimate, default=None)


def placement(d: Degrees, tasks_per_node: int) -> list[dict]:
    """Every rank with its node and mesh coordinates."""
    rows = []
    for rank in range(d.world):
        c = coords(rank, d)
        rows.append({"rank": rank, "node": node_of(rank, tasks_per_node), **dataclasses.asdict(c)})
    return rows
