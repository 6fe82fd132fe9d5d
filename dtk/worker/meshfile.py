"""mesh.json: the mesh the workers really built, for people and for the test that holds
plan.md against it. Every rank reports its node and the members of each of its axis
groups (as torch.distributed sees them); global rank 0 writes them all, once per start."""

from __future__ import annotations

import dataclasses
import os
import socket

import torch.distributed as dist

from dtk.common.rundir import MESH_FILE, RunDir, write_json_atomic
from dtk.mesh.mesh import ParallelMesh
from dtk.plan.degrees import Axis, CarvedAxis
from dtk.worker.env import WorkerEnv


def record_mesh(mesh: ParallelMesh, env: WorkerEnv, run: RunDir) -> None:
    """Collective (every rank calls it after the mesh is built)."""
    mine = {
        "rank": env.rank,
        "node_rank": env.node_rank,
        # lab nodes share one hostname: Slurm's name for the node tells them apart
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "groups": {a.value: dist.get_process_group_ranks(mesh.group(a)) for a in (*Axis, *CarvedAxis)
                   if mesh.group(a) is not None},
    }
    everyone: list[dict[str, object] | None] = [mine]
    if mesh.world is not None:
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, mine)
    if env.rank == 0:
        write_json_atomic(run.path / MESH_FILE, {"start": env.restart, "degrees": dataclasses.asdict(mesh.degrees),
                                                "ranks": everyone})
