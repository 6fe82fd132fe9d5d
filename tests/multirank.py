"""In-process multi-rank tests: run a function on N gloo ranks and collect what each returns.

`run_on_ranks(fn, world_size, tmp_path, *args)` spawns `world_size` processes, joins them
in a gloo process group (file rendezvous: no port to collide with other tests), calls
`fn(rank, world_size, *args)` on each and returns the list of return values, rank order.
An exception on any rank fails the call with that rank's traceback. A test module runs its
checks in one start of the ranks (tests/test_multirank.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# fork: the children inherit the parent's imported torch and dtk, so a check starts in well
# under a second; a spawn re-imports everything (about 5x slower on a busy 2-core machine).
# Checked with a warm intra-op thread pool in the parent (tests run after other tests).
START_METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _entry(rank: int, fn: Callable[..., Any], world_size: int, folder: str, args: tuple) -> None:
    torch.set_num_threads(1)  # N processes on a small machine
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), f"{folder}/result_{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any) -> list[Any]:
    folder = tmp_path / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_entry, args=(fn, world_size, str(folder), args), nprocs=world_size, start_method=START_METHOD)
    return [torch.load(folder / f"result_{rank}.pt", weights_only=False) for rank in range(world_size)]
