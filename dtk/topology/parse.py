"""Parsers of what nodes print: sysfs values, `ip -j addr`, `nvidia-smi topo -m`,
`nvidia-smi --query-gpu`, `scontrol show topology`, Slurm host lists. Pure functions."""

from __future__ import annotations

import json
import re

from dtk.topology.records import Gpu, Switch


def cpulist(text: str) -> list[int]:
    """`0-55,112-167` -> [0, 1, ..., 55, 112, ..., 167] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def ib_state(text: str) -> str:
    """`4: ACTIVE` -> `ACTIVE`; `5: LinkUp` -> `LinkUp`."""
    return text.strip().split(":", 1)[-1].strip()


def ib_rate_gbps(text: str) -> float:
    """`200 Gb/sec (4X HDR)` -> 200.0; `2.5 Gb/sec (1X SDR)` -> 2.5; unknown -> 0."""
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", text)
    return float(m.group(1)) if m else 0.0


def ip_addresses(text: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """`ip -j addr show` -> {interface: (IPv4 with prefix, global IPv6 with prefix)}."""
    out: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for link in json.loads(text or "[]"):
        v4, v6 = [], []
        for a in link.get("addr_info", []):
            addr = f"{a['local']}/{a['prefixlen']}"
            if a.get("family") == "inet":
                v4.append(addr)
            elif a.get("family") == "inet6" and a.get("scope") == "global":
                v6.append(addr)
        out[link["ifname"]] = (tuple(v4), tuple(v6))
    return out


def gpu_query(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        memory = int(cells[3]) if len(cells) > 3 and cells[3].isdigit() else None
        gpus.append(Gpu(index=int(cells[0]), name=cells[1], bus_id=cells[2], memory_mib=memory))
    return gpus


def topo_matrix(text: str) -> tuple[list[list[str]], dict[str, str], dict[int, list[str]], dict[int, int]]:
    """`nvidia-smi topo -m` -> (GPU x GPU links, NIC column -> device, GPU -> its row's
    NIC cells, GPU -> NUMA affinity). The table is tab-separated; the header starts with
    a tab; the self cell reads ` X `; a legend follows after a blank line."""
    lines = text.splitlines()
    header_at = next((i for i, ln in enumerate(lines) if ln.strip().startswith("GPU0")), None)
    if header_at is None:
        return [], {}, {}, {}
    header = [c.strip() for c in lines[header_at].split("\t")]
    header = header[1:] if header and header[0] == "" else header
    gpu_cols = [c for c in header if re.fullmatch(r"GPU\d+", c)]
    nic_cols = [c for c in header if re.fullmatch(r"NIC\d+|mlx\S+", c)]
    numa_col = header.index("NUMA Affinity") if "NUMA Affinity" in header else None
    links: list[list[str]] = []
    nic_cells: dict[int, list[str]] = {}
    numa: dict[int, int] = {}
    for line in lines[header_at + 1:]:
        cells = [c.strip() for c in line.split("\t")]
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            if links:
                break
            continue
        index = int(cells[0][3:])
        row = cells[1:]
        links.append(row[: len(gpu_cols)])
        nic_cells[index] = row[len(gpu_cols): len(gpu_cols) + len(nic_cols)]
        if numa_col is not None and numa_col < len(row) and row[numa_col].isdigit():
            numa[index] = int(row[numa_col])
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, flags=re.M))
    names = {col: legend.get(col, col) for col in nic_cols}
    return links, names, {g: [names[c] + "=" + v for c, v in zip(nic_cols, cells, strict=False)]
                          for g, cells in nic_cells.items()}, numa


def closest_nics(nic_cells: dict[int, list[str]]) -> dict[int, str]:
    """GPU -> the adapter behind the fewest PCIe hops (PIX, else PXB), if any."""
    out: dict[int, str] = {}
    for gpu, cells in nic_cells.items():
        for level in ("PIX", "PXB"):
            match = [c.split("=")[0] for c in cells if c.endswith("=" + level)]
            if match:
                out[gpu] = match[0]
                break
    return out


def hostlist(text: str) -> list[str]:
    """A Slurm host list: `dgx-[001-003,007],login1` -> dgx-001 dgx-002 dgx-003 dgx-007 login1.
    Zero padding is kept, as Slurm keeps it."""
    names: list[str] = []
    for prefix, ranges, suffix, plain in re.findall(r"([^,\[\]]+)\[([^\]]+)\]([^,\[\]]*)|([^,\[\]]+)", text.strip()):
        if plain:
            names.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            names += [f"{prefix}{k:0{width}d}{suffix}" for k in range(int(lo), int(hi or lo) + 1)]
    return names




def switches(text: str) -> list[Switch]:
    """`scontrol show topology`: one `SwitchName=s0 Level=0 LinkSpeed=1 Nodes=... Switches=...`
    line per switch. Empty when the cluster has no topology plugin configured."""
    out = []
    for line in text.splitlines():
        kv = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if "SwitchName" not in kv:
            continue
        out.append(Switch(
            name=kv["SwitchName"],
            level=int(kv.get("Level", "0")),
            nodes=tuple(hostlist(kv["Nodes"])) if kv.get("Nodes") else (),
            switches=tuple(hostlist(kv["Switches"])) if kv.get("Switches") else (),
        ))
    return out
