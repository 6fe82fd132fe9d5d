"""python -m dtk.topology show | record DIR | choose DIR... | discover --out DIR"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dtk.common.errors import ArgumentParser, UserError, run_cli
from dtk.topology.choose import choose
from dtk.topology.discover import discover
from dtk.topology.layout import MESH_ORDER, plan_layout
from dtk.topology.records import NodeTopology
from dtk.topology.source import LiveSource, RecordedSource, RecordingSource


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m dtk.topology",
                            description="What a node has (InfiniBand / RoCE ports, interfaces, GPUs and their "
                                        "links, NUMA, Slurm's view) and the NCCL / gloo settings dtk derives from it.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    show = commands.add_parser("show", help="this node's record and the settings of a one-node job")
    show.add_argument("--json", action="store_true", help="the record as JSON")
    record = commands.add_parser("record", help="record what discovery reads on this node into DIR (a fixture)")
    record.add_argument("dir", type=Path)
    pick = commands.add_parser("choose", help="settings and layout of a job on recorded nodes (folders from `record`)")
    pick.add_argument("dirs", type=Path, nargs="+", metavar="DIR")
    pick.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    pick.add_argument("--tasks-per-node", type=int, default=0, help="default: the GPUs of the first node, else 1")
    found = commands.add_parser("discover", help="write this node's record to DIR/<node>.json (the driver's step)")
    found.add_argument("--out", type=Path, required=True)
    return parser


def describe(node: NodeTopology) -> str:
    lines = [f"node        {node.node} (host {node.hostname}), {node.num_cpus} CPUs, "
             f"NUMA {', '.join(f'{k}: {v}' for k, v in node.numa_nodes.items()) or '?'}"]
    for p in node.ib_ports:
        lines.append(f"rdma        {p.name:<10} {p.state}/{p.phys_state} {p.rate_gbps:g} Gb/s {p.link_layer}"
                     f" ({p.hca_type or '?'}, netdev {p.netdev or '-'})")
    for i in node.interfaces:
        speed = f"{i.speed_mbps / 1000:g} Gb/s" if i.speed_mbps else "speed ?"
        lines.append(f"interface   {i.name:<10} {i.kind:<8} {i.operstate:<7} {speed:<10} mtu {i.mtu}"
                     f" {' '.join(i.ipv4) or '-'}{' (virtual)' if i.virtual else ''}")
    if node.gpus:
        domains = " ".join("[" + ",".join(map(str, d)) + "]" for d in node.nvlink_domains())
        lines.append(f"gpus        {len(node.gpus)} x {node.gpus[0].name}; NVLink domains {domains}")
    if node.slurm.job_id:
        lines.append(f"slurm       job {node.slurm.job_id} on {' '.join(node.slurm.job_nodes)};"
                     f" {len(node.slurm.switches)} switch(es) reported")
    lines += [f"note        {n}" for n in node.notes]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "show":
        node = discover()
        print(json.dumps(node.to_dict(), indent=1) if args.json else describe(node))
        if not args.json:
            print("\n".join(choose([node], backend="nccl" if node.gpus else "gloo").describe()))
    elif args.command == "record":
        node = discover(RecordingSource(LiveSource(), args.dir))
        print(f"recorded {node.node} into {args.dir}")
    elif args.command == "discover":
        node = discover()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{node.node}.json").write_text(json.dumps(node.to_dict(), indent=1) + "\n")
    else:
        try:
            nodes = [discover(RecordedSource(d)) for d in args.dirs]
        except FileNotFoundError as exc:
            raise UserError(str(exc)) from None
        tpn = args.tasks_per_node or len(nodes[0].gpus) or 1
        print("\n".join(choose(nodes, backend=args.backend).describe()))
        world = tpn * len(nodes)
        degrees = {**dict.fromkeys(MESH_ORDER, 1), "dp_replicate": len(nodes), "dp_shard": world // len(nodes)}
        print("\n".join(plan_layout(nodes, degrees=degrees, tasks_per_node=tpn).describe()))
    return 0


if __name__ == "__main__":
    run_cli(main)
