"""Discovery: what this node has, read through one `Source` (see dtk.topology.source).

    /sys/class/infiniband/<dev>/ports/<n>/{state,phys_state,rate,link_layer}
                                           gid_attrs/{types,ndevs}/<i>, gids/<i> (RoCE)
    /sys/class/net/<if>/{type,operstate,speed,mtu,device/uevent,dev_port}
    ip -j addr show                         addresses
    nvidia-smi --query-gpu=... / topo -m    GPUs, NVLink and PCIe distances, NIC affinity
    /sys/devices/system/{cpu,node}/...      CPUs and NUMA nodes
    $SLURMD_NODENAME, $SLURM_JOB_NODELIST, scontrol show topology    Slurm's view

Nothing here fails on a machine that lacks a part: what could not be read is left empty
and said in `notes`.
"""

from __future__ import annotations

from dtk.topology import parse
from dtk.topology.records import ETHERNET, IbPort, NetInterface, NodeTopology, SlurmView, Switch
from dtk.topology.source import LiveSource, Source

SYS_IB = "/sys/class/infiniband"
SYS_NET = "/sys/class/net"
SYS_NODE = "/sys/devices/system/node"
GPU_QUERY = ["nvidia-smi", "--query-gpu=index,name,pci.bus_id,memory.total", "--format=csv,noheader,nounits"]
GPU_TOPO = ["nvidia-smi", "topo", "-m"]
IP_ADDR = ["ip", "-j", "addr", "show"]
SLURM_TOPOLOGY = ["scontrol", "show", "topology"]
# RoCE GID tables hold link-local and IPv4-mapped entries first; mlx5 puts the IPv4 ones at 2-3.
MAX_GID_INDEX = 16
# /sys/class/net/<if>/type: ARPHRD_* numbers from include/uapi/linux/if_arp.h.
LINK_TYPES = {"1": "ether", "32": "ipoib", "772": "loopback"}


def _int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def discover(source: Source | None = None) -> NodeTopology:
    src = source or LiveSource()
    notes: list[str] = []
    hostname = (src.read("/proc/sys/kernel/hostname") or src.env("HOSTNAME") or "localhost").strip()
    slurm = _slurm(src)
    online = src.read("/sys/devices/system/cpu/online")
    gpus, links, gpu_nics = _gpus(src, notes)
    return NodeTopology(
        node=slurm.node_name or hostname,
        hostname=hostname,
        num_cpus=len(parse.cpulist(online)) if online else 0,
        numa_nodes=_numa(src),
        ib_ports=tuple(_ib_ports(src)),
        interfaces=tuple(_interfaces(src, notes)),
        gpus=tuple(gpus),
        gpu_links=tuple(tuple(row) for row in links),
        gpu_nics=gpu_nics,
        slurm=slurm,
        notes=tuple(notes),
    )


def _numa(src: Source) -> dict[int, str]:
    online = src.read(f"{SYS_NODE}/online")
    if not online:
        return {}
    return {k: (src.read(f"{SYS_NODE}/node{k}/cpulist") or "").strip() for k in parse.cpulist(online)}


def _interfaces(src: Source, notes: list[str]) -> list[NetInterface]:
    raw = src.run(IP_ADDR)
    addresses = parse.ip_addresses(raw) if raw else {}
    if raw is None:
        notes.append("`ip -j addr` unavailable: interface addresses unknown")
    out = []
    for name in src.listdir(SYS_NET):
        base = f"{SYS_NET}/{name}"
        link_type = src.read(f"{base}/type")
        if link_type is None:  # bonding_masters and other files beside the interfaces
            continue
        uevent = src.read(f"{base}/device/uevent")
        speed = _int(src.read(f"{base}/speed"))
        v4, v6 = addresses.get(name, ((), ()))
        out.append(NetInterface(
            name=name,
            kind=LINK_TYPES.get(link_type.strip(), "other"),
            operstate=(src.read(f"{base}/operstate") or "unknown").strip(),
            speed_mbps=speed if speed and speed > 0 else None,
            mtu=_int(src.read(f"{base}/mtu")) or 0,
            ipv4=v4,
            ipv6=v6,
            virtual=uevent is None,
            driver=_uevent(uevent or "").get("DRIVER", ""),
        ))
    return out


def _uevent(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _ib_ports(src: Source) -> list[IbPort]:
    ports = []
    for device in src.listdir(SYS_IB):
        base = f"{SYS_IB}/{device}"
        hca_type = (src.read(f"{base}/hca_type") or "").strip()
        numa = _int(src.read(f"{base}/device/numa_node"))
        netdevs = src.listdir(f"{base}/device/net")
        for port_name in src.listdir(f"{base}/ports"):
            port = int(port_name)
            pbase = f"{base}/ports/{port_name}"
            link_layer = (src.read(f"{pbase}/link_layer") or "InfiniBand").strip()
            netdev, gid_index = None, None
            if link_layer == ETHERNET:
                gid_index, netdev = _roce_v2_gid(src, pbase)
            if netdev is None:
                netdev = _port_netdev(src, netdevs, port)
            ports.append(IbPort(
                device=device,
                port=port,
                state=parse.ib_state(src.read(f"{pbase}/state") or "DOWN"),
                phys_state=parse.ib_state(src.read(f"{pbase}/phys_state") or "Disabled"),
                rate_gbps=parse.ib_rate_gbps(src.read(f"{pbase}/rate") or ""),
                link_layer=link_layer,
                hca_type=hca_type,
                netdev=netdev,
                roce_v2_gid_index=gid_index,
                numa_node=numa if numa is not None and numa >= 0 else None,
            ))
    return ports


def _roce_v2_gid(src: Source, pbase: str) -> tuple[int | None, str | None]:
    """The GID index whose type is RoCE v2 and whose GID is an IPv4-mapped address: the
    one that routes between subnets, which NCCL_IB_GID_INDEX should name."""
    for index in range(MAX_GID_INDEX):
        kind = src.read(f"{pbase}/gid_attrs/types/{index}")
        gid = (src.read(f"{pbase}/gids/{index}") or "").strip()
        if kind and kind.strip() == "RoCE v2" and gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            ndev = src.read(f"{pbase}/gid_attrs/ndevs/{index}")
            return index, ndev.strip() if ndev else None
    return None, None


def _port_netdev(src: Source, netdevs: list[str], port: int) -> str | None:
    """The interface of an adapter's port: the only one, or the one whose dev_port (0-based)
    is this port's number minus one."""
    if len(netdevs) == 1:
        return netdevs[0]
    for name in netdevs:
        if _int(src.read(f"{SYS_NET}/{name}/dev_port")) == port - 1:
            return name
    return None


def _gpus(src: Source, notes: list[str]):
    text = src.run(GPU_QUERY)
    if text is None:
        return [], [], {}
    gpus = parse.gpu_query(text)
    topo = src.run(GPU_TOPO)
    if topo is None:
        notes.append("`nvidia-smi topo -m` failed: GPU links unknown")
        return gpus, [], {}
    links, _names, nic_cells, numa = parse.topo_matrix(topo)
    gpus = [g.__class__(**{**g.__dict__, "numa_node": numa.get(g.index)}) for g in gpus]
    return gpus, links, parse.closest_nics(nic_cells)


def _slurm(src: Source) -> SlurmView:
    job_id = src.env("SLURM_JOB_ID")
    nodelist = src.env("SLURM_JOB_NODELIST") or ""
    switches: tuple[Switch, ...] = ()
    if job_id:
        text = src.run(SLURM_TOPOLOGY)
        switches = tuple(parse.switches(text)) if text else ()
    return SlurmView(
        node_name=src.env("SLURMD_NODENAME"),
        job_id=job_id,
        job_nodes=tuple(parse.hostlist(nodelist)) if nodelist else (),
        switches=switches,
    )
