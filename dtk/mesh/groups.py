"""Process groups made after the world's, with the world's timeout.

`init_process_group(timeout=dist.timeout_s)` sets the timeout of the world group only:
groups made later with `new_group` or `split_group` (the DeviceMesh's axes, the checkpoint
and stop-vote groups) get torch's defaults instead (10 minutes for NCCL, 30 for gloo), so a
peer that hangs inside a save or a collective of one axis would be seen that much later.
Every group dtk makes is made here, or given the world's timeout here once made.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def timeout_of(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The timeout a group's collectives run under (its first backend's), None if unknown."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:  # no process group yet
        return None
    for device in ("cuda", "cpu"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):  # no backend for that device type
            continue
    return None


def new_group(**kwargs) -> dist.ProcessGroup:
    """Collective: dist.new_group with the world's timeout."""
    return dist.new_group(timeout=timeout_of(), **kwargs)


def give_world_timeout(groups: list[dist.ProcessGroup]) -> None:
    """Groups made by torch (a DeviceMesh's) run under the world's timeout from now on."""
    timeout = timeout_of()
    if timeout is None:
        return
    for group in groups:
        if timeout_of(group) != timeout:
            c10d._set_pg_timeout(timeout, group)
