"""Where each mesh axis's traffic goes, from the job's nodes. Pure, no torch.

The mesh (dtk.mesh.mesh) lays ranks out as

    rank = arange(dp_replicate * pp * dp_shard * tp).view(dp_replicate, pp, dp_shard, tp)

and a node holds consecutive ranks, so the innermost axes (tp, then dp_shard) stay inside
a node and the outermost (pp, dp_replicate) cross nodes. What the topology adds:

- the node order: nodes under one leaf switch (Slurm's topology/tree) are made adjacent,
  so an axis that spans a few nodes spans one switch, not the spine;
- each axis's span: one NVLink domain, one node over PCIe or shared memory, nodes under
  one switch, or across switches; and a warning where a chatty axis leaves its node;
- the traffic classes and the process group each travels on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dtk.plan.degrees import CARVED_TRAFFIC, Axis, CarvedAxis, Degrees
from dtk.plan.degrees import TRAFFIC as AXIS_TRAFFIC
from dtk.plan.layout import axis_groups as plan_axis_groups
from dtk.topology.records import NodeTopology, Switch

# The mesh's axes, outermost first, and what travels on each: the axis table of dtk.plan.degrees.
MESH_ORDER = Axis.values()
# Axes carved out of the grid's (expert parallelism): drawn when used, before the grid's.
CARVED = CarvedAxis.values()
_TABLE: dict[str, tuple[str, str]] = {**{str(a): t for a, t in AXIS_TRAFFIC.items()}, **{str(a): t for a, t in CARVED_TRAFFIC.items()}}
TRAFFIC = {str(axis): text for axis, (_, text) in _TABLE.items()}
_CLASS = {str(axis): kind for axis, (kind, _) in _TABLE.items()}
CHECKPOINT = ("checkpoint", "world (gloo)", "state metadata and the save/load plan: a gloo group of its own, "
              "apart from the NCCL communicators")


@dataclass(frozen=True)
class AxisSpan:
    axis: str
    size: int
    span: str
    """`one rank`, `NVLink`, `inside a node`, `one switch` or `across nodes`."""
    traffic: str
    example: tuple[int, ...]
    """The ranks of rank 0's group."""


@dataclass(frozen=True)
class Layout:
    node_order: tuple[str, ...]
    order_why: str
    rank_nodes: tuple[str, ...]
    """Global rank -> node."""
    axes: tuple[AxisSpan, ...]
    traffic: tuple[tuple[str, str, str], ...]
    """(class, process group, what travels) for every class this job has."""
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> list[str]:
        lines = [f"nodes       {' '.join(self.node_order)} ({self.order_why})"]
        for a in self.axes:
            if a.size > 1:
                lines.append(f"  {a.axis:<12} {a.size:>4}  {a.span:<14} {a.traffic}")
        per_node: dict[str, list[int]] = {}
        for rank, node in enumerate(self.rank_nodes):
            per_node.setdefault(node, []).append(rank)
        lines.append("ranks       " + "; ".join(f"{n}: {_ranges(r)}" for n, r in per_node.items()))
        lines += [f"warning     {w}" for w in self.warnings]
        return lines


def _ranges(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) else \
        ",".join(map(str, ranks))


def order_nodes(nodes: list[str], switches: tuple[Switch, ...] | list[Switch]) -> tuple[list[str], str]:
    """Nodes under one leaf switch made adjacent, leaves in the order their first node
    appears; unchanged when Slurm reports no switches."""
    leaves = [s for s in switches if s.level == 0]
    if not leaves:
        return list(nodes), "allocation order; Slurm reports no switches"
    leaf_of = {node: i for i, s in enumerate(leaves) for node in s.nodes}
    first: dict[int, int] = {}
    for pos, node in enumerate(nodes):
        first.setdefault(leaf_of.get(node, len(leaves)), pos)
    ordered = sorted(nodes, key=lambda n: (first[leaf_of.get(n, len(leaves))], nodes.index(n)))
    groups: dict[str, list[str]] = {}
    for node in ordered:
        leaf = leaves[leaf_of[node]].name if node in leaf_of else "no switch"
        groups.setdefault(leaf, []).append(node)
    why = "kept together under their switch: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in groups.items())
    return ordered, why


def axis_groups(degrees: dict[str, int], axis: str) -> list[tuple[int, ...]]:
    """The rank groups of one axis on the mesh grid: the planner's (dtk.plan.layout)."""
    return [tuple(group) for group in plan_axis_groups(Degrees(**degrees), axis)]


def plan_layout(nodes: list[NodeTopology], *, degrees: dict[str, int], tasks_per_node: int) -> Layout:
    """The layout of a job of len(nodes) x tasks_per_node ranks with these degrees (an axis
    left out has degree 1)."""
    degrees = {**dict.fromkeys(MESH_ORDER, 1), **degrees}
    names = [n.node for n in nodes]
    switches = next((n.slurm.switches for n in nodes if n.slurm.switches), ())
    order, why = order_nodes(names, switches)
    by_name = {n.node: n for n in nodes}
    rank_nodes = tuple(node for node in order for _ in range(tasks_per_node))
    leaf_of = {node: s.name for s in switches if s.level == 0 for node in s.nodes}
    axes, warnings = [], []
    carved = [axis for axis in CARVED if degrees.get(axis, 1) > 1]
    for axis in [*carved, *reversed(MESH_ORDER)]:  # innermost first: the chattiest axis leads
        groups = axis_groups(degrees, axis)
        span = _span(groups, rank_nodes, by_name, tasks_per_node, leaf_of)
        axes.append(AxisSpan(axis, degrees[axis], span, TRAFFIC[axis], groups[0]))
        if axis == "tp" and span in ("one switch", "across nodes"):
            warnings.append(f"scheme.tp={degrees['tp']} spans nodes: tensor-parallel all-reduces in every block"
                            f" cross the network; keep scheme.tp <= tasks_per_node={tasks_per_node}")
        elif axis == "tp" and span == "inside a node" and any(n.gpus for n in nodes):
            domains = " ".join("[" + ",".join(map(str, d)) + "]" for d in nodes[0].nvlink_domains())
            warnings.append(f"scheme.tp={degrees['tp']} spans GPUs of {nodes[0].node} that no NVLink joins"
                            f" (NVLink domains {domains}): tensor-parallel traffic crosses PCIe")
    traffic = [(_CLASS[a.axis], a.axis, a.traffic) for a in axes if a.size > 1]
    traffic.append(CHECKPOINT)
    return Layout(tuple(order), why, rank_nodes, tuple(axes), tuple(traffic), tuple(warnings))


def _span(groups, rank_nodes, by_name, tasks_per_node, leaf_of) -> str:
    if len(groups[0]) == 1:
        return "one rank"
    node_sets = [{rank_nodes[r] for r in g} for g in groups]
    if all(len(s) == 1 for s in node_sets):
        for g in groups:
            node = by_name[rank_nodes[g[0]]]
            domains = node.nvlink_domains()
            if not node.gpus:
                return "inside a node"
            gpus = {(r % tasks_per_node) % len(node.gpus) for r in g}
            if not any(gpus <= set(d) for d in domains) or all(len(d) == 1 for d in domains):
                return "inside a node"
        return "NVLink"
    if leaf_of and all(len({leaf_of.get(n, n) for n in s}) == 1 for s in node_sets):
        return "one switch"
    return "across nodes"
