"""NCCL's own report of the transport each communicator chose, and the check that stops a
job whose nodes have InfiniBand but whose NCCL fell back to TCP sockets (several times
slower, and NCCL says nothing unless asked).

The workers run with NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET and NCCL_DEBUG_FILE set
to one file per process; the lines read here are:

    host:pid:tid [dev] NCCL INFO Using network IB                    the process's network
    host:pid:tid [dev] NCCL INFO NET/IB : No device found.            why it is not IB
    host:pid:tid [dev] NCCL INFO comm 0x.. rank 0 nRanks 16 nNodes 2 localRanks 8 ...
    host:pid:tid [dev] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0
    host:pid:tid [dev] NCCL INFO ncclCommInitRank comm 0x.. rank 0 nranks 16 ... - Init COMPLETE

A process loads one network for all its communicators; a communicator that spans nodes
sends over it (its `via NET/...` channel lines say the same).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from dtk.topology.choose import CLUSTER_ENV, DETECTED, LABELS, FabricChoice
from dtk.topology.records import NodeTopology

REQUIRE = ("auto", "ib", "any")
_PREFIX = r"^(?:\[\d+\]\s*)?(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[[^\]]*\] NCCL (?P<level>INFO|WARN) "
_LINE = re.compile(_PREFIX + r"(?P<msg>.*)$")
_COMM_INFO = re.compile(r"comm (0x[0-9a-f]+) rank (\d+) nRanks (\d+) nNodes (\d+)")
_INIT_DONE = re.compile(r"comm (0x[0-9a-f]+) rank (\d+) nranks (\d+) .*Init COMPLETE")
_VIA_NET = re.compile(r"via NET/([^/\s]+)")
_NET_TROUBLE = re.compile(r"NET/IB\S* : No device found|libibverbs|ibv_|NCCL_IB_DISABLE set|Failed to open")


@dataclass(frozen=True)
class Communicator:
    comm: str
    rank: int
    num_ranks: int
    num_nodes: int | None
    network: str | None
    """What it sends over between nodes: `IB`, `Socket`, a plugin's name; None if unknown."""


@dataclass(frozen=True)
class NcclReport:
    """One process's NCCL debug output, read."""

    host: str
    pid: int
    network: str | None
    communicators: tuple[Communicator, ...]
    clues: tuple[str, ...] = ()
    """NCCL's lines about why the network is what it is (no IB device, verbs missing)."""


def network_kind(name: str | None) -> str:
    """`IB`, `IBext_v8` (the SHARP plugin) -> ib; `Socket` -> socket; others (AWS Libfabric,
    a vendor plugin) -> other."""
    if not name:
        return "unknown"
    if name.lower().startswith("socket"):
        return "socket"
    return "ib" if name.upper().startswith("IB") else "other"


def parse_log(text: str) -> list[NcclReport]:
    """Every process found in a debug file (one file usually holds one process)."""
    procs: dict[tuple[str, int], dict] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        key = (m["host"], int(m["pid"]))
        p = procs.setdefault(key, {"network": None, "comms": {}, "order": [], "tid_comm": {}, "clues": []})
        msg, tid = m["msg"], m["tid"]
        if msg.startswith("Using network "):
            p["network"] = msg[len("Using network "):].strip()
        elif _NET_TROUBLE.search(msg):
            p["clues"].append(msg.strip())
        if (info := _COMM_INFO.search(msg)) is not None:
            comm = p["comms"].setdefault(info[1], {"rank": int(info[2]), "nranks": int(info[3]), "nets": set()})
            comm["nnodes"] = int(info[4])
            p["tid_comm"][tid] = info[1]
            if info[1] not in p["order"]:
                p["order"].append(info[1])
        elif (done := _INIT_DONE.search(msg)) is not None:
            p["comms"].setdefault(done[1], {"rank": int(done[2]), "nranks": int(done[3]), "nets": set()})
            if done[1] not in p["order"]:
                p["order"].append(done[1])
        elif (via := _VIA_NET.search(msg)) is not None and tid in p["tid_comm"]:
            p["comms"][p["tid_comm"][tid]]["nets"].add(via[1])
    reports = []
    for (host, pid), p in procs.items():
        comms = []
        for cid in p["order"]:
            c = p["comms"][cid]
            nnodes = c.get("nnodes")
            nets = sorted(c["nets"])
            network = nets[0] if len(nets) == 1 else ("+".join(nets) if nets else None)
            if network is None and (nnodes or 0) > 1:
                network = p["network"]
            comms.append(Communicator(cid, c["rank"], c["nranks"], nnodes, network))
        reports.append(NcclReport(host, pid, p["network"], tuple(comms), tuple(dict.fromkeys(p["clues"]))))
    return reports


def warn_lines(text: str) -> list[str]:
    """NCCL's WARN lines: with dtk's report on they go to the report file with the rest,
    so the worker repeats them on its own stderr (NCCL keeps one stream for every level)."""
    return [line.strip() for line in text.splitlines() if " NCCL WARN " in line]


@dataclass(frozen=True)
class TransportCheck:
    require: str
    verified: bool
    """NCCL's report was read for every node that crosses nodes."""
    per_node: dict[str, list[dict]]
    problems: tuple[str, ...] = ()
    note: str = ""
    """Why nothing was checked, where nothing needed it (one node)."""

    def to_dict(self) -> dict:
        return asdict(self)


def check(nodes: list[NodeTopology], reports: dict[str, list[NcclReport]], *, choice: FabricChoice,
          require: str, backend: str) -> TransportCheck:
    """Compare what NCCL chose on each node with what the node has. A problem is a
    one-line message naming the node and the setting to fix; the caller stops the job."""
    assert require in REQUIRE, require
    if len(nodes) == 1:  # no communicator crosses nodes: there is no network to use or to miss
        found = [asdict(c) | {"pid": r.pid} for r in reports.get(nodes[0].node, []) for c in r.communicators]
        return TransportCheck(require, True, {nodes[0].node: found},
                              note="one node: NCCL uses no network, fabric.require does not apply")
    problems: list[str] = []
    has_rdma = {n.node: [p for p in n.active_ports()] for n in nodes}
    if require == "ib":
        lacking = [name for name, ports in has_rdma.items() if not ports]
        if backend != "nccl":
            problems.append(f"fabric.require=ib but the job runs {backend}, which only speaks TCP; "
                            "run on GPUs with dist.backend=nccl, or set fabric.require=auto")
        elif lacking:
            problems.append(f"fabric.require=ib but node {lacking[0]} has no active InfiniBand or RoCE port"
                            f" ({_ports(nodes, lacking[0])}); exclude it (cluster.exclude_from) or set fabric.require=auto")
    per_node: dict[str, list[dict]] = {}
    verified = True
    for node in nodes:
        node_reports = reports.get(node.node, [])
        per_node[node.node] = [asdict(c) | {"pid": r.pid} for r in node_reports for c in r.communicators]
        crossing = [(r, c) for r in node_reports for c in r.communicators if (c.num_nodes or 0) > 1]
        if backend == "nccl" and not crossing:
            verified = False
        wants_ib = require == "ib" or (require == "auto" and has_rdma[node.node] and choice.transport != "socket")
        if backend != "nccl" or not wants_ib or problems:
            continue
        for report, comm in crossing:
            if network_kind(comm.network) != "socket":
                continue
            problems.append(_socket_problem(node, report, comm, choice, require))
            break
    if require == "ib" and backend == "nccl" and not verified and not problems:
        problems.append("fabric.require=ib but NCCL's report of its transport could not be read on every node"
                        " (NCCL_DEBUG or NCCL_DEBUG_FILE set by hand?); unset them, or set fabric.require=auto")
    return TransportCheck(require, verified, per_node, tuple(problems[:1] if problems else ()))


def _ports(nodes: list[NodeTopology], name: str) -> str:
    node = next(n for n in nodes if n.node == name)
    return ", ".join(f"{p.name} {p.state}" for p in node.ib_ports) or "no RDMA adapter found"


def _socket_problem(node: NodeTopology, report: NcclReport, comm: Communicator, choice: FabricChoice,
                    require: str) -> str:
    ports = ", ".join(f"{p.name} {p.rate_gbps:g} Gb/s" for p in node.active_ports())
    fix = _fix(choice, node.node, report)
    kinds = "/".join(LABELS[k] for k in sorted({p.kind for p in node.active_ports()}))
    return (f"node {node.node} has {kinds} ({ports}) but NCCL"
            f" chose TCP sockets (NET/{comm.network}) for communicator {comm.comm} ({comm.num_ranks} ranks on"
            f" {comm.num_nodes} nodes), several times slower; {fix}; or set fabric.require=any to train on"
            f" sockets anyway (now fabric.require={require})")


def _fix(choice: FabricChoice, node: str, report: NcclReport) -> str:
    disable = choice.setting("NCCL_IB_DISABLE")
    if disable is not None and disable.value not in ("", "0") and disable.source != DETECTED:
        where = "cluster.env" if disable.source == CLUSTER_ENV else "the environment (a site setup file?)"
        return f"NCCL_IB_DISABLE={disable.value} comes from {where}: remove it"
    hca = choice.setting("NCCL_IB_HCA", node)
    if hca is not None and hca.source != DETECTED:
        return f"NCCL_IB_HCA={hca.value} ({hca.source}) names no usable port of {node}: fix or remove it"
    clue = f"NCCL said: {report.clues[0]!r}; " if report.clues else ""
    return (f"{clue}check that {node} has the RDMA userspace NCCL loads (rdma-core: libibverbs.so.1) and that"
            f" NCCL_IB_HCA={hca.value if hca else '(unset)'} matches its ports")
