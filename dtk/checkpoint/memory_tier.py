"""The in-memory snapshot tier (checkpoint.memory_every): snapshots of each rank's own state
in its node's /dev/shm, a replica on a partner node, restored at a relaunch before the disk.

A snapshot: on the training thread, the rank's state is copied to CPU tensors (model and
optimizer state with DTensors as their local shards, scheduler, RNG streams; the data
position is the step). A background thread serializes it, takes its CRC32, writes it to the
node's store, swaps replicas with the ring partners (dtk.checkpoint.memory_store) over a
gloo group only it uses, then gathers every rank's CRC: past that gather every shard and
replica of the step is in place, and each node's first rank writes the commit record.

A restore (collective, at a start): the ranks gather what their nodes hold, agree on the
step (memory_store.choose), read or receive their shard, check its CRC, and apply it only
when every rank's shard checked out; otherwise the reason goes to the disk load's event.
It never reads the run directory's checkpoints.
"""

from __future__ import annotations

import io
import socket
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtk.checkpoint import memory_store as ms
from dtk.checkpoint.rng import rng_state, set_rng_state
from dtk.checkpoint.sharded import Comm
from dtk.rundir import memory_store


def node_name() -> str:
    import os

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, DTensor):
        return obj.to_local().detach().to("cpu", copy=True)
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class MemoryTier:
    """Every rank holds one; `__init__`, `snapshot`'s background half and `restore` are collective."""

    def __init__(self, run_path: Path, *, every: int, rank: int, world: int, local_rank: int, per_node: int,
                 parts: list[tuple[torch.nn.Module, torch.optim.Optimizer]], scheduler: Any,
                 identity: dict[str, Any], fresh: bool) -> None:
        self.every = every
        self.rank, self.world, self.local_rank, self.per_node = rank, world, local_rank, per_node
        self.parts = parts
        self.scheduler = scheduler
        self.identity = identity
        self.node = node_name()
        self.store = memory_store(run_path) / self.node
        self.comm = Comm.create()  # a gloo group of the tier's own: the snapshot thread's traffic
        self.group = self.comm.group
        if fresh and local_rank == 0:  # a new run of this run directory: an earlier one's store is stale
            import shutil

            shutil.rmtree(self.store, ignore_errors=True)
        self.comm.barrier()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtk-memtier")
        self._pending: Future | None = None
        self.blocked_s: list[float] = []  # the training thread's time per snapshot (waiting + copying)

    # --- snapshot -------------------------------------------------------------------------

    def snapshot(self, step: int) -> None:
        """Copy this rank's state of `step` to CPU (the training thread's part) and hand the rest
        to the background thread; the previous snapshot is finished first."""
        t0 = time.perf_counter()
        self.wait()
        state = {
            "step": step,
            "model": [_to_cpu(module.state_dict()) for module, _ in self.parts],
            "optim": [_to_cpu(optimizer.state_dict()) for _, optimizer in self.parts],
            "scheduler": _to_cpu(self.scheduler.state_dict()),
            "rng": rng_state(),
        }
        self._pending = self._thread.submit(self._write, step, state)
        self.blocked_s.append(time.perf_counter() - t0)

    def wait(self) -> None:
        """Local: the snapshot in flight is written, replicated and committed (or failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except Exception as exc:  # a lost snapshot costs nothing but the tier: the disk stays
                print(f"memory snapshot failed on rank {self.rank}: {exc}", flush=True)

    def _write(self, step: int, state: dict[str, Any]) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        crc = zlib.crc32(data)
        ms.write_shard(self.store, step, "own", self.rank, data, crc)
        partner = ms.partner(self.rank, self.world, self.per_node)
        source = ms.replica_of(self.rank, self.world, self.per_node)
        if partner is not None and source is not None and self.group is not None:
            size = torch.tensor([len(data)], dtype=torch.int64)
            incoming = torch.zeros(1, dtype=torch.int64)
            works = [dist.isend(size, partner, group=self.group), dist.irecv(incoming, source, group=self.group)]
            for w in works:
                if w is not None:
                    w.wait()
            received = torch.empty(int(incoming.item()), dtype=torch.uint8)
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            works = [dist.isend(payload, partner, group=self.group), dist.irecv(received, source, group=self.group)]
            for w in works:
                if w is not None:
                    w.wait()
            got = received.numpy().tobytes()
            ms.write_shard(self.store, step, "replica", source, got, zlib.crc32(got))
        crcs = self.comm.all_gather(crc)  # past this, every rank's shard and replica of the step is written
        if self.local_rank == 0:
            ms.write_commit(self.store, ms.commit_record(step, world_size=self.world, identity=self.identity,
                                                         crcs=crcs))
            ms.prune(self.store)

    # --- restore --------------------------------------------------------------------------

    def restore(self, *, disk_step: int) -> tuple[ms.Choice, float]:
        """Collective: restore the newest complete snapshot newer than `disk_step`. Returns the
        choice (step None: nothing restored, with its reason) and the seconds it took."""
        t0 = time.perf_counter()
        reports = self.comm.all_gather({"node": self.node, "steps": ms.holdings(self.store)})
        choice = ms.choose(reports, world=self.world, identity=self.identity, disk_step=disk_step)
        if choice.step is None:
            return choice, time.perf_counter() - t0
        data, problem = self._fetch(choice)
        problems = [p for p in self.comm.all_gather(problem) if p]
        if problems:
            return ms.Choice(None, reason=problems[0]), time.perf_counter() - t0
        state = torch.load(io.BytesIO(data), weights_only=True)
        self._apply(state)
        return choice, time.perf_counter() - t0

    def _fetch(self, choice: ms.Choice) -> tuple[bytes, str | None]:
        """This rank's shard: read from its node, or received from the rank whose node holds it.
        The pairs go in one global order, so no send waits on a receive that waits on it."""
        assert choice.step is not None
        mine, problem = b"", None
        for rank, (holder, kind) in sorted(choice.sources.items()):
            if holder != self.rank and rank != self.rank:
                continue
            data = b""
            if holder == self.rank:
                try:
                    data, _ = ms.read_shard(self.store, choice.step, kind, rank)
                except OSError as exc:
                    data, problem = b"", f"rank {rank}: its {kind} shard could not be read ({exc})"
            if holder != rank:
                assert self.group is not None
                if holder == self.rank:
                    dist.send(torch.tensor([len(data)], dtype=torch.int64), rank, group=self.group)
                    if data:
                        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), rank, group=self.group)
                    continue
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, holder, group=self.group)
                buf = torch.empty(int(size.item()), dtype=torch.uint8)
                if int(size.item()):
                    dist.recv(buf, holder, group=self.group)
                data = buf.numpy().tobytes()
            mine = data
            if not data and problem is None:
                problem = f"rank {rank}: its {kind} shard on rank {holder}'s node could not be read"
            elif zlib.crc32(data) != choice.crcs[rank]:
                problem = f"rank {rank}: CRC mismatch of its {kind} shard of step {choice.step} on rank {holder}'s node"
        return mine, problem

    def _apply(self, state: dict[str, Any]) -> None:
        for (module, optimizer), model_sd, optim_sd in zip(self.parts, state["model"], state["optim"], strict=True):
            with torch.no_grad():
                for key, target in module.state_dict().items():
                    local = target.to_local() if isinstance(target, DTensor) else target
                    local.copy_(model_sd[key])
            optimizer.load_state_dict(optim_sd)
            for group in optimizer.param_groups:  # the optimizer's state of a DTensor parameter is one too
                for p in group["params"]:
                    if not isinstance(p, DTensor):
                        continue
                    for k, v in optimizer.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == p.to_local().shape:
                            optimizer.state[p][k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                                                       run_check=False, shape=p.shape, stride=p.stride())
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])

    def close(self, *, discard: bool) -> None:
        """Finish the snapshot in flight; `discard`: the run is durable on disk (finished or
        stopped), this node's store is removed."""
        self.wait()
        self._thread.shutdown(wait=True)
        if discard:
            self.comm.barrier()
            if self.local_rank == 0:
                import shutil

                shutil.rmtree(self.store.parent, ignore_errors=True)
