"""Where am I, and what did my driver say? Everything a worker reads from its environment.

Rank and world: each launcher names the same facts differently; ENV_TABLES is the whole
mapping. The local driver's own variables win, then torchrun's, then Slurm's (srun sets
SLURM_* in every task), then a single process.

What a driver tells its workers besides: DRIVER_ENV, written by both drivers (the local
one and the Slurm supervisor) through `driver_env`, read here and nowhere else.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

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


# What a driver tells each worker of a start (the same variables from both drivers).
DRIVER_ENV: dict[str, str] = {
    "master_addr": "DTK_MASTER_ADDR",  # rendezvous host: the first node of the start
    "master_port": "DTK_MASTER_PORT",  # rendezvous port, free on that host
    "restart": "DTK_RESTART",  # this start's number in the run: 0, 1, ... (logs/start_NN, events)
    "plan": "DTK_PLAN",  # the plan.json this start trains by (a shrunk plan after a node loss)
    "recovery_from": "DTK_RECOVERY_FROM",  # when the fault this start recovers from was seen (epoch s); "" if none
}
DEFAULT_MASTER_PORT = 29500  # torch's default, when nobody says


def rank_env(*, rank: int, local_rank: int, world_size: int, local_world_size: int, node_rank: int) -> dict[str, str]:
    """Rank and world for a worker the local driver starts itself (srun sets Slurm's own)."""
    values = {"rank": rank, "local_rank": local_rank, "world_size": world_size,
              "local_world_size": local_world_size, "node_rank": node_rank}
    return {ENV_TABLES["dtk"][key]: str(value) for key, value in values.items()}


def driver_env(
    *, master_addr: str, master_port: int, restart: int, plan: Path | str, recovery_from: float | None
) -> dict[str, str]:
    """The DRIVER_ENV variables of one start, for the environment of its workers."""
    values = {"master_addr": master_addr, "master_port": master_port, "restart": restart, "plan": plan,
              "recovery_from": recovery_from or ""}
    return {DRIVER_ENV[key]: str(value) for key, value in values.items()}


@dataclass(frozen=True)
class WorkerEnv:
    source: str
    """Which launcher's variables gave the rank: dtk, torchrun, slurm or single."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    restart: int = 0
    """The start this worker belongs to (0 for the first)."""
    plan: str | None = None
    """plan.json to train by; None: RUN_DIR/plan.json."""
    recovery_from: float = 0.0
    """When the driver saw the fault this start recovers from (epoch seconds); 0: not a recovery."""
    job_id: str | None = None
    """The Slurm job, when there is one."""
    cpus_per_task: int = 0
    """CPU cores Slurm allotted this task; 0: not said."""


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
    said = {key: env.get(var) or None for key, var in DRIVER_ENV.items()}
    addr = said["master_addr"] or env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        addr = _first_host(nodelist) if nodelist else "127.0.0.1"
    port = int(said["master_port"] or env.get("MASTER_PORT") or DEFAULT_MASTER_PORT)
    return WorkerEnv(
        source=source,
        master_addr=addr,
        master_port=port,
        restart=int(said["restart"] or 0),
        plan=said["plan"],
        recovery_from=float(said["recovery_from"] or 0),
        job_id=env.get("SLURM_JOB_ID") or None,
        cpus_per_task=int(env.get("SLURM_CPUS_PER_TASK") or 0),
        **values,
    )
