"""The fabric at start, in the worker: discovery and the environment before the process
group (dtk.topology.start), then the check of NCCL's own report after it.

    before   the node's first rank discovers and publishes; every rank gathers all
             records, chooses, sets NCCL_* / GLOO_SOCKET_IFNAME / the master address;
             rank 0 writes topology.json and the `topology` event
    after    one collective makes NCCL build and connect its communicator; each rank reads
             its report, rank 0 checks all of them against the nodes (fabric.require) and
             every rank stops with the same `error:` line when the fabric is not used
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dtk.common.errors import UserError
from dtk.common.rundir import TOPOLOGY_JSON, RunDir
from dtk.config.choices import Backend, ClusterKind, DeviceKind
from dtk.plan.binding import gpu_step_flags
from dtk.plan.plan import Plan
from dtk.topology.choose import FabricChoice
from dtk.topology.discover import discover
from dtk.topology.nccl import check, parse_log, warn_lines
from dtk.topology.records import NodeTopology
from dtk.topology.start import StartFabric, decide, gather, publish, write_document
from dtk.worker.env import WorkerEnv
from dtk.worker.placement import Placement, binding_name, place_this_worker


def backend_of(want: Backend, device: torch.device) -> str:
    if want == Backend.auto:
        return "nccl" if device.type == "cuda" else "gloo"
    return want.value


def before_process_group(plan: Plan, env: WorkerEnv, run: RunDir, *, device: torch.device) -> tuple[WorkerEnv, StartFabric | None]:
    """Set the fabric's variables in this process; returns the worker env with the chosen
    master address, and the start's fabric (None with fabric.detect=false)."""
    cfg = plan.config
    if not cfg.fabric.detect:
        os.environ.update({k: str(v) for k, v in cfg.cluster.env.items()})
        return env, None
    folder = run.log_dir(env.restart) / "topology"
    if env.local_rank == 0:
        publish(folder, env.node_rank, discover())
    nodes = gather(folder, env.world_size // env.local_world_size, timeout_s=cfg.fault.startup_timeout_s)
    fabric = decide(
        nodes, node_rank=env.node_rank, rank=env.rank, backend=backend_of(cfg.dist.backend, device),
        degrees=dataclasses.asdict(plan.degrees), tasks_per_node=env.local_world_size,
        cluster_env={k: str(v) for k, v in cfg.cluster.env.items()}, environ=os.environ,
        report_dir=run.log_dir(env.restart) / "nccl",
    )
    if fabric.nccl_log is not None:
        fabric.nccl_log.parent.mkdir(parents=True, exist_ok=True)
    os.environ.update(fabric.env)
    if env.rank == 0:
        write_document(run.path / TOPOLOGY_JSON, fabric.document() | {"restart": env.restart})
        run.event("topology", restart=env.restart, **fabric.event())
    return dataclasses.replace(env, master_addr=fabric.choice.master_addr), fabric


def _own_reports(log: Path | None) -> list:
    if log is None or not log.exists():
        return []
    return parse_log(log.read_text(errors="replace"))


def check_transport(*, nodes: list[NodeTopology], node: str, choice: FabricChoice, require: str, backend: str,
                    nccl_log: Path | None, device: torch.device) -> tuple[str | None, dict]:
    """Collective: every rank returns the same (problem or None, the check as a dict)."""
    if backend == "nccl":  # NCCL connects lazily: one small all-reduce builds the world communicator
        dist.all_reduce(torch.ones(1, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (node, _own_reports(nccl_log)))
    verdict: list = [None]
    if dist.get_rank() == 0:
        reports: dict[str, list] = {}
        for name, rank_reports in gathered:
            reports.setdefault(name, []).extend(rank_reports)
        result = check(nodes, reports, choice=choice, require=require, backend=backend)
        verdict = [(result.problems[0] if result.problems else None, result.to_dict())]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def after_process_group(fabric: StartFabric | None, plan: Plan, env: WorkerEnv, run: RunDir, *,
                        device: torch.device) -> None:
    """Stop before training (UserError on every rank) when NCCL does not use the fabric."""
    if fabric is None:
        return
    problem, result = check_transport(
        nodes=list(fabric.nodes), node=fabric.node, choice=fabric.choice, require=plan.config.fabric.require.value,
        backend=fabric.choice.backend, nccl_log=fabric.nccl_log, device=device)
    if fabric.nccl_log is not None and fabric.nccl_log.exists():
        for line in warn_lines(fabric.nccl_log.read_text(errors="replace")):
            print(f"{line} (from {fabric.nccl_log.name})", file=sys.stderr, flush=True)
    if env.rank == 0:
        path = run.path / TOPOLOGY_JSON
        write_document(path, json.loads(path.read_text()) | {"transport_check": result})
    if problem:
        raise UserError(problem)


def place_worker(plan: Plan, env: WorkerEnv, run: RunDir) -> Placement:
    """This worker's GPU and CPUs (dtk.worker.placement), bound before torch starts its
    threads. A CPU worker on a node with a GPU per task (the GPU-shaped lab) records the
    GPU it would use; one of more workers than GPUs uses none."""
    cfg = plan.config
    cuda = cfg.dist.device == DeviceKind.cuda or (cfg.dist.device == DeviceKind.auto and torch.cuda.is_available())
    would = 0 < plan.tasks_per_node <= cfg.cluster.gpus_per_node
    return place_this_worker(
        rank=env.rank, node=os.environ.get("SLURMD_NODENAME") or socket.gethostname(), node_rank=env.node_rank,
        local_rank=env.local_rank, local_world_size=env.local_world_size, meet=run.log_dir(env.restart) / "gpus",
        timeout_s=cfg.fault.startup_timeout_s, wants_gpu=cuda or would,
        binding=binding_name(gpu_step_flags(plan), gpu_bind=cfg.cluster.gpu_bind,
                             slurm=cfg.cluster.kind == ClusterKind.slurm))


def record_placement(placement: Placement, env: WorkerEnv, run: RunDir) -> None:
    """Collective: every rank's placement into topology.json (`placement`, by rank)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, placement.to_dict())
    if env.rank == 0:
        path = run.path / TOPOLOGY_JSON
        document = json.loads(path.read_text()) if path.exists() else {"restart": env.restart}
        write_document(path, document | {"placement": gathered})
