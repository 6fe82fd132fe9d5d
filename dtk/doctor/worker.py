"""One rank of the doctor's job: `python -m dtk.doctor.worker OUT` (OUT/request.json says
what to measure). The fabric is found and set as a training start does (dtk.topology.start);
then, on the started group, the all-reduce sweeps, the p2p matrix and the matmul, and rank 0
writes doctor.json, report.md and exclude.txt into OUT."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dtk.common.errors import ArgumentParser
from dtk.config.choices import Backend, DeviceKind
from dtk.doctor import measure
from dtk.doctor.report import REPORT, RESULTS, analyze, exclude_text, render, slow_links
from dtk.mesh.init import init_process_group, pick_device
from dtk.plan.degrees import Axis
from dtk.topology.discover import discover
from dtk.topology.start import decide, gather, publish

REQUEST = "request.json"


def run(out: Path) -> None:
    from dtk.worker.env import read_env

    req = json.loads((out / REQUEST).read_text())
    env = read_env()
    device = pick_device(DeviceKind(req["device"]), env)
    if device.type == "cpu":
        # What Slurm allotted the task, else the node's cores split: ranks of lab nodes share
        # one machine, and threads beyond its cores make one rank's matmul several times slower.
        torch.set_num_threads(env.cpus_per_task or max(1, (os.cpu_count() or 1) // env.local_world_size))
    backend = req["backend"] if req["backend"] != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    num_nodes, tpn = env.world_size // env.local_world_size, env.local_world_size
    folder = out / "topology"
    if env.local_rank == 0:
        publish(folder, env.node_rank, discover())
    nodes = gather(folder, num_nodes, timeout_s=req["startup_timeout_s"])
    fabric = decide(nodes, node_rank=env.node_rank, rank=env.rank, backend=backend,
                    degrees=dict.fromkeys(Axis.values(), 1) | {"dp_replicate": num_nodes, "dp_shard": tpn},
                    tasks_per_node=tpn,
                    cluster_env=req["cluster_env"], environ=os.environ, report_dir=out / "nccl")
    os.environ.update({k: v for k, v in fabric.env.items() if not k.startswith("NCCL_DEBUG")})
    env = env.__class__(**{**env.__dict__, "master_addr": fabric.choice.master_addr})
    init_process_group(env, backend=Backend(backend), device=device, timeout_s=req["timeout_s"], cpu_collectives=False)
    names = [n.node for n in nodes]
    node_ranks = [list(range(k * tpn, (k + 1) * tpn)) for k in range(num_nodes)]
    leaders = [r[0] for r in node_ranks]
    # Every rank creates every group, in one order (new_group is collective over the world).
    per_node = [dist.new_group(r) for r in node_ranks]
    across = dist.new_group(leaders) if num_nodes > 1 else None
    sizes, repeats = req["sizes_mb"], req["repeats"]

    results: dict = {"nodes": [n.to_dict() for n in nodes], "fabric": fabric.choice.describe(),
                     "backend": backend, "device": device.type, "tasks_per_node": tpn, "groups": []}
    rows = measure.all_reduce_sweep(group=None, group_size=env.world_size, sizes=sizes, repeats=repeats, device=device)
    results["groups"].append({"group": "world", "ranks": env.world_size, "rows": measure.rows_dict(rows)})
    if across is not None:
        rows = measure.all_reduce_sweep(group=across, group_size=num_nodes, sizes=sizes, repeats=repeats,
                                        device=device) if env.rank in leaders else []
        if env.rank == 0:
            results["groups"].append({"group": "across nodes (first rank of each)", "ranks": num_nodes,
                                      "rows": measure.rows_dict(rows)})
        dist.barrier()
    intra = []
    if tpn > 1 and num_nodes > 1:  # every node's group at once, as in training (one node: the world)
        intra = measure.all_reduce_sweep(group=per_node[env.node_rank], group_size=tpn, sizes=sizes,
                                         repeats=repeats, device=device)
    p2p = measure.p2p_matrix(leaders=leaders, size_mb=req["p2p_mb"], repeats=repeats,
                             device=device) if num_nodes > 1 else {}
    flops = measure.matmul_tflops(n=req["matmul_n"], repeats=repeats, device=device)
    mine = {"node": names[env.node_rank], "local_rank": env.local_rank, "matmul_tflops": flops,
            "p2p": {f"{i}->{j}": bw for (i, j), bw in p2p.items()},
            "intra": measure.rows_dict(intra) if env.local_rank == 0 else []}
    everyone = measure.gather_to_zero(mine)
    if env.rank == 0:
        for r in everyone:
            if r["intra"]:
                results["groups"].append({"group": f"inside {r['node']}", "ranks": tpn, "rows": r["intra"]})
        results["p2p_gbs"] = {f"{names[int(k.split('->')[0])]}->{names[int(k.split('->')[1])]}": v
                              for r in everyone for k, v in r["p2p"].items()}
        results["matmul_tflops"] = {n: [r["matmul_tflops"] for r in everyone if r["node"] == n] for n in names}
        results["flagged"] = analyze(results, slow_factor=req["slow_factor"])
        results["slow_links"] = slow_links(results, slow_factor=req["slow_factor"], flagged=results["flagged"])
        (out / RESULTS).write_text(json.dumps(results, indent=1) + "\n")
        (out / REPORT).write_text(render(results, out=out))
        (out / "exclude.txt").write_text(exclude_text(results["flagged"]))
    dist.barrier()


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m dtk.doctor.worker", description="One rank of the doctor's job;"
                            " python -m dtk.doctor starts it.")
    parser.add_argument("out", metavar="OUT", type=Path, help="the doctor's folder (holds request.json)")
    out = parser.parse_args(argv).out
    try:
        run(out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
