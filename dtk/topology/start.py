"""The fabric of one start, before its process group: each node's record published in the
run directory, gathered in node-rank order by every rank, the environment chosen from all
of them and set, and `topology.json` written. No torch: the worker wires it (dtk.worker.fabric).

    logs/start_NN/topology/node_KK.json    what node KK found (its first rank discovers)
    logs/start_NN/nccl/NODE.rankR.log      NCCL's own report of rank R (NCCL_DEBUG=INFO)
    topology.json                          the records, the choice and why, the layout,
                                           and the transport check once NCCL answered

Every rank computes the same choice from the same records (choose is pure), so no rank
waits for another's decision, only for the records. The run directory is on storage every
node sees, which is what makes it a place to meet before any process group exists.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtk.topology.choose import FabricChoice, choose
from dtk.topology.layout import Layout, plan_layout
from dtk.topology.records import NodeTopology

POLL_S = 0.2
# NCCL writes one stream (stdout, or NCCL_DEBUG_FILE) for every level. dtk's report raises
# the level to INFO for the INIT and NET subsystems only and sends the stream to a file per
# rank, WARN lines included: so where NCCL_DEBUG asks for warnings at most (dtk's setup
# file says WARN) the report is written, and where someone asked for more (INFO, TRACE) or
# chose a file of their own, their setting stands and the transport is not verified.
QUIET_LEVELS = ("", "VERSION", "WARN")


def writes_nccl_report(backend: str, settings: Mapping[str, str]) -> bool:
    """Whether dtk sets NCCL_DEBUG / NCCL_DEBUG_SUBSYS / NCCL_DEBUG_FILE for its report."""
    return (backend == "nccl" and "NCCL_DEBUG_FILE" not in settings
            and settings.get("NCCL_DEBUG", "").strip().upper() in QUIET_LEVELS)


def node_file(folder: Path, node_rank: int) -> Path:
    return folder / f"node_{node_rank:02d}.json"


def publish(folder: Path, node_rank: int, node: NodeTopology) -> None:
    """Write one node's record whole (a reader never sees half of it)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = node_file(folder, node_rank)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(node.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)


def gather(folder: Path, num_nodes: int, *, timeout_s: float, sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic) -> list[NodeTopology]:
    """Every node's record, in node-rank order; waits for those not yet published."""
    deadline = clock() + timeout_s
    while True:
        missing = [k for k in range(num_nodes) if not node_file(folder, k).exists()]
        if not missing:
            return [NodeTopology.from_dict(json.loads(node_file(folder, k).read_text())) for k in range(num_nodes)]
        if clock() > deadline:
            raise RuntimeError(f"node(s) {', '.join(map(str, missing))} of this start published no topology record in"
                               f" {folder} within {timeout_s:g} s (is the run directory shared by every node?)")
        sleep(POLL_S)


@dataclass(frozen=True)
class StartFabric:
    """What one rank of a start knows about the fabric before its process group."""

    nodes: tuple[NodeTopology, ...]
    node: str
    """This rank's node."""
    choice: FabricChoice
    layout: Layout
    env: dict[str, str]
    """What was set in this process's environment (the choice, and NCCL's report file)."""
    nccl_log: Path | None
    """Where NCCL reports for this rank; None: NCCL_DEBUG set by hand, or not NCCL."""
    rank_nodes: tuple[str, ...] = ()
    """Global rank -> node as this start runs (node-rank order, consecutive ranks per node).
    The layout's own order keeps nodes of one switch together; the two differ only when
    Slurm reports switches and allocated the nodes in another order."""

    def document(self) -> dict[str, Any]:
        """topology.json: what each node has, what was chosen on each and why, the layout."""
        return {
            "nodes": [n.to_dict() for n in self.nodes],
            "choice": self.choice.to_dict(),
            "env": {n.node: self.choice.env_for(n.node) for n in self.nodes},
            "rank_nodes": list(self.rank_nodes),
            "layout": self.layout.to_dict(),
            "describe": self.choice.describe() + self.layout.describe(),
        }

    def event(self) -> dict[str, Any]:
        """The details of the `topology` event: enough to see what the start ran on."""
        return {"transport": self.choice.transport, "interface": self.choice.interface,
                "master_addr": self.choice.master_addr, "env": self.choice.env_for(self.nodes[0].node),
                "rank_nodes": list(self.rank_nodes)}


def decide(nodes: list[NodeTopology], *, node_rank: int, rank: int, backend: str, degrees: dict[str, int],
           tasks_per_node: int, cluster_env: Mapping[str, str], environ: Mapping[str, str],
           report_dir: Path) -> StartFabric:
    """The choice for this start and the variables this rank sets (pure: the caller sets them)."""
    choice = choose(nodes, backend=backend, cluster_env=cluster_env, environ=environ)
    node = nodes[node_rank].node
    env = choice.env_for(node)
    nccl_log = None
    if writes_nccl_report(backend, {**environ, **cluster_env}):
        nccl_log = report_dir / f"{node}.rank{rank}.log"
        env |= {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(nccl_log)}
    layout = plan_layout(nodes, degrees=degrees, tasks_per_node=tasks_per_node)
    rank_nodes = tuple(n.node for n in nodes for _ in range(tasks_per_node))
    return StartFabric(tuple(nodes), node, choice, layout, env, nccl_log, rank_nodes)


def write_document(path: Path, document: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(tmp, path)
