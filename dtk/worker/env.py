"""Where am I? Rank, world and rendezvous from whichever launcher started this process.

Each launcher names the same facts differently; the tables below are the whole mapping.
The driver's own variables win, then torchrun's, then Slurm's (srun sets SLURM_* in every
task), then a single process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

ENV_TABLES: dict[str, dict[str, str]] = {
    "dtk": {
        "rank": "DTK_RANK",
        "local_rank": "DTK_LOCAL_RANK",
        "world_size": "DTK_WORLD_SIZE",
        "local_world_size": "DTK_LOCAL_WORLD_SIZE",
        "node_rank": "DTK_NODE_RANK",
    },
    "torchrun": {
        "rank": "RANK",
        "local_rank": "LOCAL_RANK",
        "world_size": "WORLD_SIZE",
        "local_world_size": "LOCAL_WORLD_SIZE",
        "node_rank": "GROUP_RANK",
    },
    "slurm": {
        "rank": "SLURM_PROCID",
        "local_rank": "SLURM_LOCALID",
        "world_size": "SLURM_NTASKS",
        "node_rank": "SLURM_NODEID",
    },
}


@dataclass(frozen=True)
class WorkerEnv:
    source: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int


def _first_host(nodelist: str) -> str:
    """First host of a Slurm node list: `node[3-5,9]` -> `node3`, `a1,b2` -> `a1`."""
    m = re.match(r"([^,\[]+)(?:\[(\d+)[^\]]*\])?", nodelist)
    if not m:
        return nodelist
    return m.group(1) + (m.group(2) or "")


def _slurm_local_world(env: Mapping[str, str]) -> int:
    """SLURM_STEP_TASKS_PER_NODE looks like `2(x3)` or `2,1`; this node's count is what we need."""
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    counts: list[int] = []
    for part in tasks.split(","):
        m = re.match(r"(\d+)(?:\(x(\d+)\))?", part)
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else counts[-1]


def read_env(env: Mapping[str, str] | None = None) -> WorkerEnv:
    env = os.environ if env is None else env
    for source in ("dtk", "torchrun", "slurm"):
        table = ENV_TABLES[source]
        if table["rank"] in env and table["world_size"] in env:
            values = {key: int(env[var]) for key, var in table.items() if var in env}
            break
    else:
        source, values = "single", {"rank": 0, "world_size": 1}
    if "local_world_size" not in values:
        values["local_world_size"] = _slurm_local_world(env) if source == "slurm" else values["world_size"]
    values.setdefault("local_rank", values["rank"] % values["local_world_size"])
    values.setdefault("node_rank", values["rank"] // values["local_world_size"])
    addr = env.get("DTK_MASTER_ADDR") or env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        addr = _first_host(nodelist) if nodelist else "127.0.0.1"
    port = int(env.get("DTK_MASTER_PORT") or env.get("MASTER_PORT") or 29500)
    return WorkerEnv(source=source, master_addr=addr, master_port=port, **values)
