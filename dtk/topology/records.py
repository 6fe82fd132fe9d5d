"""What one node has, as data: the `NodeTopology` record every node contributes to
`topology.json`. Plain frozen dataclasses that round-trip through JSON, so the driver,
the workers, the doctor and the tests all speak of the same thing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

IB = "InfiniBand"
ETHERNET = "Ethernet"


@dataclass(frozen=True)
class IbPort:
    """One port of an RDMA adapter (/sys/class/infiniband/<device>/ports/<port>)."""

    device: str
    """Adapter name, e.g. `mlx5_0`."""
    port: int
    state: str
    """Logical state: ACTIVE, DOWN, INIT (no subnet manager yet) or ARMED."""
    phys_state: str
    """Physical state: LinkUp, Disabled, Polling, ..."""
    rate_gbps: float
    link_layer: str
    """`InfiniBand`, or `Ethernet` for RoCE."""
    hca_type: str = ""
    """Adapter model as the driver names it (MT4123 = ConnectX-6, MT4129 = ConnectX-7)."""
    netdev: str | None = None
    """The network interface of this port: IPoIB (`ib0`) or the RoCE Ethernet interface."""
    roce_v2_gid_index: int | None = None
    """GID index of the port's RoCE v2 IPv4 address (what NCCL_IB_GID_INDEX names)."""
    numa_node: int | None = None

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state == "LinkUp"

    @property
    def kind(self) -> str:
        return "roce" if self.link_layer == ETHERNET else "ib"

    @property
    def name(self) -> str:
        """NCCL's way of naming it: `mlx5_0:1`."""
        return f"{self.device}:{self.port}"


@dataclass(frozen=True)
class NetInterface:
    """A network interface (/sys/class/net/<name>) and its addresses."""

    name: str
    kind: str
    """`ether`, `ipoib`, `loopback` or `other` (from the interface type)."""
    operstate: str
    """up, down, unknown (loopback and some virtual links), lowerlayerdown, ..."""
    speed_mbps: int | None
    """Link speed; None when the kernel does not know (down links, virtio, loopback)."""
    mtu: int
    ipv4: tuple[str, ...] = ()
    """Addresses with prefix length, e.g. `10.10.0.11/16`."""
    ipv6: tuple[str, ...] = ()
    virtual: bool = False
    """No device behind it (bridge, veth, docker0, loopback)."""
    driver: str = ""

    @property
    def usable(self) -> bool:
        """Up (or `unknown`, which loopback and some virtual links report) with an IPv4 address."""
        return self.operstate in ("up", "unknown") and bool(self.ipv4)


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    bus_id: str
    memory_mib: int | None = None
    numa_node: int | None = None


@dataclass(frozen=True)
class Switch:
    """A switch as Slurm's topology/tree plugin reports it (`scontrol show topology`)."""

    name: str
    level: int
    nodes: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()


@dataclass(frozen=True)
class SlurmView:
    node_name: str | None = None
    """SLURMD_NODENAME: the node as Slurm names it (lab nodes share one hostname)."""
    job_id: str | None = None
    job_nodes: tuple[str, ...] = ()
    switches: tuple[Switch, ...] = ()


@dataclass(frozen=True)
class NodeTopology:
    """Everything discovery found on one node."""

    node: str
    """The node's name in the job: Slurm's name when there is one, else the hostname."""
    hostname: str
    num_cpus: int
    numa_nodes: dict[int, str] = field(default_factory=dict)
    """NUMA node -> its CPU list, e.g. {0: "0-55,112-167"}."""
    ib_ports: tuple[IbPort, ...] = ()
    interfaces: tuple[NetInterface, ...] = ()
    gpus: tuple[Gpu, ...] = ()
    gpu_links: tuple[tuple[str, ...], ...] = ()
    """`nvidia-smi topo -m` between GPUs: gpu_links[i][j] is X, NV18, PIX, PXB, PHB, NODE or SYS."""
    gpu_nics: dict[int, str] = field(default_factory=dict)
    """GPU index -> the RDMA adapter closest to it (PIX/PXB in `nvidia-smi topo -m`)."""
    slurm: SlurmView = field(default_factory=SlurmView)
    notes: tuple[str, ...] = ()
    """What discovery could not read, in words (no nvidia-smi, no `ip`, ...)."""

    def active_ports(self) -> tuple[IbPort, ...]:
        return tuple(p for p in self.ib_ports if p.active)

    def interface(self, name: str) -> NetInterface | None:
        return next((i for i in self.interfaces if i.name == name), None)

    def nvlink_domains(self) -> list[tuple[int, ...]]:
        """GPUs that reach each other over NVLink, as groups (cliques of `NV#` links); a
        GPU without NVLink is a domain of its own."""
        n = len(self.gpus)
        domains: list[tuple[int, ...]] = []
        seen: set[int] = set()
        for i in range(n):
            if i in seen:
                continue
            group = [i] + [j for j in range(n) if j != i and self._nvlink(i, j)]
            group = [g for g in group if all(g == h or self._nvlink(g, h) for h in group)]
            seen.update(group)
            domains.append(tuple(sorted(group)))
        return domains

    def _nvlink(self, i: int, j: int) -> bool:
        try:
            return self.gpu_links[i][j].startswith("NV")
        except IndexError:
            return False

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["numa_nodes"] = {str(k): v for k, v in self.numa_nodes.items()}
        out["gpu_nics"] = {str(k): v for k, v in self.gpu_nics.items()}
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NodeTopology:
        slurm = raw.get("slurm") or {}
        return cls(
            node=raw["node"],
            hostname=raw["hostname"],
            num_cpus=raw["num_cpus"],
            numa_nodes={int(k): v for k, v in (raw.get("numa_nodes") or {}).items()},
            ib_ports=tuple(_build(IbPort, p) for p in raw.get("ib_ports", ())),
            interfaces=tuple(_build(NetInterface, i) for i in raw.get("interfaces", ())),
            gpus=tuple(_build(Gpu, g) for g in raw.get("gpus", ())),
            gpu_links=tuple(tuple(row) for row in raw.get("gpu_links", ())),
            gpu_nics={int(k): v for k, v in (raw.get("gpu_nics") or {}).items()},
            slurm=SlurmView(
                node_name=slurm.get("node_name"),
                job_id=slurm.get("job_id"),
                job_nodes=tuple(slurm.get("job_nodes", ())),
                switches=tuple(_build(Switch, s) for s in slurm.get("switches", ())),
            ),
            notes=tuple(raw.get("notes", ())),
        )


def _build(cls, raw: dict[str, Any]):
    """A record from its dict; lists become the tuples the frozen record holds."""
    known = {f.name for f in fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in known})
