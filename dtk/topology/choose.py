"""The fabric environment of a job, chosen from its nodes' records. Pure.

    what                          chosen as
    ----------------------------  --------------------------------------------------------
    NCCL_IB_HCA (per node)        the node's ACTIVE ports, InfiniBand ones when the job has
                                  InfiniBand on every node, else RoCE ones on every node
    NCCL_IB_GID_INDEX             RoCE only: the RoCE v2 IPv4 GID index every port shares
    NCCL_IB_DISABLE=1             some node has no active port: NCCL must not mix IB and TCP
    NCCL_SOCKET_IFNAME,           the fastest interface every node has, up, with an IPv4
    GLOO_SOCKET_IFNAME            address of its own (docker0's 172.17.0.1 on every node is
                                  no way between them); never loopback across nodes
    MASTER_ADDR                   the first node's address on that interface

Anything in `cluster.env` wins, then what the environment already holds (a site setup
file sourced by the batch script, or the user's shell), then the detected choice. Every
setting carries its source and a reason, which the plan and topology.json show.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from dtk.config.fabric import CHOSEN_KEYS
from dtk.topology.records import NetInterface, NodeTopology

DETECTED, CLUSTER_ENV, ENVIRONMENT = "detected", "cluster.env", "environment"
LABELS = {"ib": "InfiniBand", "roce": "RoCE"}  # in order of preference


@dataclass(frozen=True)
class Setting:
    key: str
    value: str
    source: str
    """`detected`, `cluster.env` or `environment` (a site setup file or the shell)."""
    why: str


@dataclass(frozen=True)
class FabricChoice:
    nodes: tuple[str, ...]
    backend: str
    transport: str
    """Across nodes: `ib`, `roce` or `socket` (TCP; always so for gloo)."""
    interface: str | None
    """Interface of the rendezvous, gloo and NCCL's own sockets; None: left to them."""
    master_addr: str
    settings: tuple[Setting, ...] = ()
    node_settings: dict[str, tuple[Setting, ...]] = field(default_factory=dict)

    def env_for(self, node: str) -> dict[str, str]:
        """The variables to set on `node` (those from the environment are already there)."""
        chosen = [*self.settings, *self.node_settings.get(node, ())]
        return {s.key: s.value for s in chosen if s.source != ENVIRONMENT}

    def setting(self, key: str, node: str | None = None) -> Setting | None:
        pool = [*self.settings, *(self.node_settings.get(node, ()) if node else ())]
        return next((s for s in pool if s.key == key), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FabricChoice:
        return cls(
            nodes=tuple(raw["nodes"]),
            backend=raw["backend"],
            transport=raw["transport"],
            interface=raw["interface"],
            master_addr=raw["master_addr"],
            settings=tuple(Setting(**s) for s in raw["settings"]),
            node_settings={n: tuple(Setting(**s) for s in ss) for n, ss in raw["node_settings"].items()},
        )

    def describe(self) -> list[str]:
        """Lines for the plan and the doctor: every setting, its source and why."""
        lines = [f"transport   {self.transport} across nodes ({self.backend}); master address {self.master_addr}"]
        for s in self.settings:
            lines.append(f"  {s.key}={s.value}  [{s.source}] {s.why}")
        for node, settings in self.node_settings.items():
            for s in settings:
                lines.append(f"  {node}: {s.key}={s.value}  [{s.source}] {s.why}")
        return lines


def choose(nodes: list[NodeTopology], *, backend: str, cluster_env: Mapping[str, str] | None = None,
           environ: Mapping[str, str] | None = None) -> FabricChoice:
    """The environment for a job on `nodes` (the first holds rank 0) with `backend`
    (`nccl` or `gloo`); `cluster_env` is the config's cluster.env, `environ` the
    environment the workers inherit."""
    assert nodes, "a job has at least one node"
    assert backend in ("nccl", "gloo"), backend
    cluster_env = dict(cluster_env or {})
    environ = environ or {}
    settings: list[Setting] = []
    node_settings: dict[str, list[Setting]] = {n.node: [] for n in nodes}

    iface, iface_why = pick_interface(nodes)
    master = nodes[0].node
    if iface is not None:
        settings.append(Setting("GLOO_SOCKET_IFNAME", iface, DETECTED, iface_why))
        master = _address(nodes[0].interface(iface)) or master
    transport = "socket"
    if backend == "nccl":
        if iface is not None:
            settings.append(Setting("NCCL_SOCKET_IFNAME", f"={iface}", DETECTED,
                                    "NCCL's bootstrap and out-of-band sockets on the same interface (= : exact name)"))
        transport = _rdma(nodes, settings, node_settings)
    settings.append(Setting("MASTER_ADDR", master, DETECTED,
                            f"{nodes[0].node}'s address on {iface}" if iface else "the first node's name"))

    def overridden(setting: Setting) -> Setting:
        if setting.key in cluster_env:
            return Setting(setting.key, str(cluster_env[setting.key]), CLUSTER_ENV, "set in cluster.env (wins)")
        if setting.key in environ:
            return Setting(setting.key, environ[setting.key], ENVIRONMENT, "already in the environment (site setup file or shell)")
        return setting

    final = [overridden(s) for s in settings]
    final_nodes = {n: tuple(overridden(s) for s in ss) for n, ss in node_settings.items()}
    named = {s.key for s in final} | {s.key for ss in final_nodes.values() for s in ss}
    for key in CHOSEN_KEYS:  # set by hand although dtk chose nothing for it
        if key not in named and (key in cluster_env or key in environ):
            final.append(overridden(Setting(key, "", DETECTED, "")))
    for key, value in cluster_env.items():
        if key not in CHOSEN_KEYS:
            final.append(Setting(key, str(value), CLUSTER_ENV, "set in cluster.env"))
    master_setting = next(s for s in final if s.key == "MASTER_ADDR")
    return FabricChoice(
        nodes=tuple(n.node for n in nodes),
        backend=backend,
        transport=transport if _ib_allowed(final) else "socket",
        interface=_named_interface(final) or iface,
        master_addr=master_setting.value,
        settings=tuple(final),
        node_settings=final_nodes,
    )


def _ib_allowed(settings: list[Setting]) -> bool:
    return not any(s.key == "NCCL_IB_DISABLE" and s.value not in ("", "0") for s in settings)


def _named_interface(settings: list[Setting]) -> str | None:
    """The interface a hand-set GLOO_SOCKET_IFNAME names (its first, if a list)."""
    value = next((s.value for s in settings if s.key == "GLOO_SOCKET_IFNAME" and s.source != DETECTED), "")
    return value.split(",")[0] or None


def _address(iface: NetInterface | None) -> str | None:
    return iface.ipv4[0].split("/")[0] if iface and iface.ipv4 else None


def pick_interface(nodes: list[NodeTopology]) -> tuple[str | None, str]:
    """The fastest interface every node has, usable, with addresses that tell the nodes
    apart; on one node, loopback. Returns (name, why) or (None, why not)."""
    if len(nodes) == 1:
        node = nodes[0]
        lo = next((i for i in node.interfaces if i.kind == "loopback" and i.usable), None)
        if lo is not None:
            return lo.name, "one node: rendezvous and gloo stay on the loopback"
    shared = set.intersection(*({i.name for i in n.interfaces if i.usable and i.kind != "loopback"} for n in nodes))
    rejected = []
    candidates = []
    for name in sorted(shared):
        per_node = [n.interface(name) for n in nodes]
        clash = _same_address(nodes, name)
        if clash:
            rejected.append(f"{name} ({clash})")
            continue
        speeds = [i.speed_mbps or 0 for i in per_node if i]
        candidates.append((min(speeds), not _one_subnet(per_node), any(i.virtual for i in per_node if i), name))
    if not candidates:
        have = "; ".join(f"{n.node}: {', '.join(i.name for i in n.interfaces if i.usable) or 'none'}" for n in nodes)
        why = f"no interface with an IPv4 address is shared by every node ({have})"
        if rejected:
            why += f"; rejected {', '.join(rejected)}"
        return None, why + "; NCCL and gloo choose for themselves"
    # One subnet first (a routed network may still work, but is a guess), then speed.
    candidates.sort(key=lambda c: (c[1], -c[0], c[2], c[3]))
    speed, routed, _, name = candidates[0]
    others = ", ".join(f"{n} {_gbps(s)}" for s, _, _, n in candidates[1:])
    why = f"fastest interface on all {len(nodes)} node(s): {_gbps(speed)}"
    if routed:
        why += ", though the nodes' addresses on it are in different subnets (routed)"
    if others:
        why += f" (also shared: {others})"
    if rejected:
        why += f"; not {', '.join(rejected)}"
    return name, why


def _one_subnet(ifaces: list[NetInterface | None]) -> bool:
    """Whether the interfaces share an IPv4 network (by their first address's prefix)."""
    nets = {ipaddress.ip_interface(i.ipv4[0]).network for i in ifaces if i and i.ipv4}
    return len(nets) == 1


def _gbps(mbps: int) -> str:
    return f"{mbps / 1000:g} Gb/s" if mbps else "speed unknown"


def _same_address(nodes: list[NodeTopology], name: str) -> str:
    """Two machines with the same address on an interface cannot reach each other by it
    (docker0 is 172.17.0.1 everywhere). Nodes of one machine (the lab without network
    namespaces) share addresses legitimately."""
    seen: dict[str, NodeTopology] = {}
    for node in nodes:
        iface = node.interface(name)
        for addr in iface.ipv4 if iface else ():
            ip = str(ipaddress.ip_interface(addr).ip)
            other = seen.get(ip)
            if other is not None and other.hostname != node.hostname:
                return f"{ip} on both {other.node} and {node.node}"
            seen[ip] = node
    return ""


def _rdma(nodes: list[NodeTopology], settings: list[Setting], node_settings: dict[str, list[Setting]]) -> str:
    """NCCL's network: InfiniBand if every node has an active IB port, else RoCE if every
    node has an active RoCE port, else sockets (with IB disabled, so no node tries)."""
    for kind, label in LABELS.items():
        ports = {n.node: [p for p in n.active_ports() if p.kind == kind] for n in nodes}
        if all(ports.values()):
            for node in nodes:
                mine = ports[node.node]
                down = [p.name for p in node.ib_ports if p.kind == kind and not p.active]
                why = f"{len(mine)} active {label} port(s), {mine[0].rate_gbps:g} Gb/s each"
                if down:
                    why += f"; not {', '.join(f'{d} ({_state(node, d)})' for d in down)}"
                others = sorted({p.kind for p in node.active_ports()} - {kind})
                if others:
                    why += f"; not the {'/'.join(LABELS[o] for o in others)} ports (one fabric per job)"
                node_settings[node.node].append(
                    Setting("NCCL_IB_HCA", "=" + ",".join(p.name for p in mine), DETECTED, why))
            if kind == "roce":
                indices = {p.roce_v2_gid_index for ps in ports.values() for p in ps}
                if len(indices) == 1 and None not in indices:
                    settings.append(Setting("NCCL_IB_GID_INDEX", str(indices.pop()), DETECTED,
                                            "the RoCE v2 IPv4 GID of every port (routable between subnets)"))
            return kind
    lacking = [n.node for n in nodes if not n.active_ports()]
    why = (f"no active InfiniBand or RoCE port on {', '.join(lacking)}" if lacking and len(lacking) < len(nodes)
           else "no active InfiniBand or RoCE port on any node")
    settings.append(Setting("NCCL_IB_DISABLE", "1", DETECTED, why + ": NCCL uses TCP sockets"))
    return "socket"


def _state(node: NodeTopology, name: str) -> str:
    port = next(p for p in node.ib_ports if p.name == name)
    return f"{port.state}/{port.phys_state}"
