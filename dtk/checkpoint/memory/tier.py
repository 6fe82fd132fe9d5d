"""The in-memory snapshot tier (checkpoint.memory_every): snapshots of each rank's own state
in its node's /dev/shm, a replica on a partner node, restored at a relaunch before the disk.

A snapshot: on the training thread, the rank's model and optimizer state, flattened to DCP's
keys, is copied to CPU tensors (DTensors as their local pieces, with where each piece sits:
its layout), with the scheduler and the RNG streams; the data position is the step. A
background thread serializes it, takes its CRC32, writes it to the node's store, swaps
replicas with the ring partners (dtk.checkpoint.memory.store) over a gloo group only it
uses, then gathers every rank's CRCs: past that gather every shard and replica of the step
is in place, and each node's first rank writes the commit record.

A restore (collective, at a start): the ranks gather what their nodes hold and agree on the
step (memory_store.choose), then on the layouts of its shards; each rank plans its load
with DCP's planner against them (on another world size, or scheme, that plan reshards, as
a disk resume does), reads the shards it needs from its node or receives them from a rank
whose node holds them, checks their CRCs, and loads them through DCP
(dtk.checkpoint.memory.load). Every step is agreed by all ranks; a problem on any is the
reason on all, and the disk checkpoint loads instead. It never reads the run directory's
checkpoints.

The store's root is checked at each use (dtk.checkpoint.memory.root): a root another user
owns or can write is refused at the start with one line and a `memory_store_refused`
event, and the start goes on with disk checkpoints only. Snapshots carry the run's
generation (its number of rollbacks); `rolled_back` removes the abandoned trajectory's.
"""

from __future__ import annotations

import io
import shutil
import socket
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dtk.checkpoint.load import allocate_optimizer_state, set_parts
from dtk.checkpoint.memory import load as mload
from dtk.checkpoint.memory import root as mroot
from dtk.checkpoint.memory import store as ms
from dtk.checkpoint.rng import rng_state, set_rng_state
from dtk.checkpoint.safe import SafeLoadPlanner
from dtk.checkpoint.sharded import Comm, _state_dicts
from dtk.common.rundir import MEMORY_STORE_REFUSED, RunDir, memory_store


def _attempt(write: Callable[[], None]) -> str:
    """Run `write`; what went wrong, or an empty string."""
    try:
        write()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


class Fallback(Exception):
    """Why the memory tier is not used for this start; the same on every rank."""


def node_name() -> str:
    import os

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class MemoryTier:
    """Every rank holds one; `__init__`, `snapshot`'s background half and `restore` are collective."""

    def __init__(self, run_path: Path, *, every: int, rank: int, world: int, local_rank: int, per_node: int,
                 parts: list[tuple[torch.nn.Module, torch.optim.Optimizer]], scheduler: Any,
                 identity: dict[str, Any], fresh: bool, generation: int) -> None:
        self.every = every
        self.rank, self.world, self.local_rank, self.per_node = rank, world, local_rank, per_node
        self.parts = parts
        self.scheduler = scheduler
        self.identity = identity
        self.generation = generation  # the run's rollbacks so far: a snapshot of another is abandoned
        self.node = node_name()
        self.root = mroot.store_root(run_path)
        self.store = memory_store(run_path) / self.node
        self.comm = Comm.create()  # a gloo group of the tier's own: the snapshot thread's traffic
        self.group = self.comm.group
        self.refused = self._claim(run_path, fresh=fresh)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtk-memtier")
        self._pending: tuple[int, Future] | None = None
        self.blocked_s: list[float] = []  # the training thread's time per snapshot (waiting + copying)
        self.failures: list[tuple[int, str]] = []  # (step, why) of the snapshots not kept

    def _claim(self, run_path: Path, *, fresh: bool) -> str | None:
        """Collective. Each node's first rank makes (or checks) the root, sweeps the stores of
        runs that are over and records whose this store is; then every rank checks the root.
        A refusal on any node turns the tier off on all (its replicas cross nodes): the reason,
        printed and recorded by rank 0 as `memory_store_refused`; None: the store is trusted."""
        problem = None
        if self.local_rank == 0:
            try:
                mroot.check_root(self.root, make=True)
                mroot.sweep(self.root, keep=self.store.parent)
                if fresh:  # a new run of this run directory: an earlier one's store is stale
                    shutil.rmtree(self.store, ignore_errors=True)
                mroot.write_owner(self.store.parent, run_path=run_path, node=self.node)
            except (mroot.StoreRefused, OSError) as exc:
                problem = str(exc)
        self.comm.barrier()
        if problem is None:
            problem = self._check()
        refusals = [got for got in self.comm.all_gather((self.node, str(self.root), problem)) if got[2]]
        if not refusals:
            return None
        node, path, why = refusals[0]
        if self.local_rank == 0 and problem is None:  # a trusted node's claim: nothing will be kept there
            shutil.rmtree(self.store.parent, ignore_errors=True)
        if self.rank == 0:
            print(f"memory tier off: the store on {node} is refused ({why}); checkpoints go to disk only", flush=True)
            try:
                RunDir(run_path).event(MEMORY_STORE_REFUSED, node=node, path=path, reason=why)
            except OSError:  # the run directory's storage is gone: the line above says it
                pass
        return f"on {node}: {why}"

    def _check(self) -> str | None:
        """Local: the root checked again (owner, mode, no symlink); why it is refused, or None."""
        try:
            mroot.check_root(self.root)
        except mroot.StoreRefused as exc:
            return str(exc)
        return None

    # --- snapshot -------------------------------------------------------------------------

    def snapshot(self, step: int) -> None:
        """Copy this rank's state of `step` to CPU (the training thread's part) and hand the rest
        to the background thread; the previous snapshot is finished first."""
        if self.refused:
            return
        t0 = time.perf_counter()
        self.wait()
        model_sd, optim_sd, _ = _state_dicts(self.parts)
        tensors, objects, layout = mload.pieces({"model": model_sd, "optim": optim_sd})
        state = {"step": step, "tensors": tensors, "objects": objects,
                 "scheduler": self.scheduler.state_dict(), "rng": rng_state()}
        self._pending = step, self._thread.submit(self._write, step, state, layout)
        self.blocked_s.append(time.perf_counter() - t0)

    def wait(self) -> None:
        """Local: the snapshot in flight is written, replicated and committed (or failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            step, future = pending
            try:
                future.result()
            except Exception as exc:  # a lost snapshot costs nothing but the tier: the disk stays
                self.failures.append((step, str(exc)))
                print(f"memory snapshot failed on rank {self.rank}: {exc}", flush=True)

    def _write(self, step: int, state: dict[str, Any], layout: mload.Layout) -> None:
        """The background half of a snapshot. Every rank goes through every collective even
        when a write of its own failed (a full /dev/shm, a store that is not a folder): a rank
        that left early would leave its partner waiting on the exchange for good. The step
        is committed only when every rank wrote its shard and its replica; else each node's
        first rank removes the step's files and every rank raises the first failure."""
        buf = io.BytesIO()
        torch.save(state, buf)
        data, meta = buf.getvalue(), mload.layout_bytes(layout)
        crc, meta_crc = zlib.crc32(data), zlib.crc32(meta)
        refused = self._check()  # at each use: the root may have changed hands since the start
        failed = (f"the store is refused ({refused})" if refused
                  else _attempt(lambda: ms.write_shard(self.store, step, "own", self.rank, data, crc, meta)))
        partner = ms.partner(self.rank, self.world, self.per_node)
        source = ms.replica_of(self.rank, self.world, self.per_node)
        if partner is not None and source is not None and self.group is not None:
            sizes = torch.tensor([len(data), len(meta)], dtype=torch.int64)
            incoming = torch.zeros(2, dtype=torch.int64)
            self._exchange(sizes, partner, incoming, source)
            received = torch.empty(int(incoming.sum()), dtype=torch.uint8)
            self._exchange(torch.frombuffer(bytearray(data + meta), dtype=torch.uint8), partner, received, source)
            got = received.numpy().tobytes()
            cut = int(incoming[0])
            failed = failed or _attempt(lambda: ms.write_shard(self.store, step, "replica", source, got[:cut],
                                                               zlib.crc32(got[:cut]), got[cut:]))
        # Past this, every rank's shard and replica is written, or some rank says why not.
        gathered = self.comm.all_gather((crc, meta_crc, failed and f"rank {self.rank} on {self.node}: {failed}"))
        failures = [why for _, _, why in gathered if why]
        if failures:
            if self.local_rank == 0:
                shutil.rmtree(ms.step_dir(self.store, step), ignore_errors=True)
            raise RuntimeError(f"step {step} not kept ({len(failures)} of {self.world} ranks failed): {failures[0]}")
        if self.local_rank == 0:
            ms.write_commit(self.store, ms.commit_record(step, world_size=self.world, identity=self.identity,
                                                         crcs=[c for c, _, _ in gathered],
                                                         layout_crcs=[m for _, m, _ in gathered],
                                                         generation=self.generation))
            ms.prune(self.store, generation=self.generation)

    def _exchange(self, out: torch.Tensor, to: int, into: torch.Tensor, source: int) -> None:
        works = [dist.isend(out, to, group=self.group), dist.irecv(into, source, group=self.group)]
        for w in works:
            if w is not None:
                w.wait()

    # --- restore --------------------------------------------------------------------------

    def restore(self, *, disk_step: int) -> tuple[ms.Choice, dict[int, str], float]:
        """Collective: restore the newest complete snapshot newer than `disk_step`, resharded to
        this world. Returns the choice (step None: nothing restored, with its reason), each
        rank's tier (memory or peer) and the seconds it took."""
        t0 = time.perf_counter()
        check = self._check() if not self.refused else None
        problem = self.refused or (check and f"on {self.node}: {check}")
        reports = self.comm.all_gather({"node": self.node, "steps": {} if problem else ms.holdings(self.store),
                                        "problem": problem})
        problems = [r["problem"] for r in reports if r["problem"]]
        if problems:
            return ms.Choice(None, reason=f"the memory store is refused ({problems[0]})"), {}, time.perf_counter() - t0
        choice = ms.choose(reports, world=self.world, identity=self.identity, disk_step=disk_step,
                           generation=self.generation)
        if choice.step is None:
            return choice, {}, time.perf_counter() - t0
        try:
            tiers = self._restore(choice, [r["node"] for r in reports])
        except Fallback as exc:
            return ms.Choice(None, reason=str(exc)), {}, time.perf_counter() - t0
        return choice, tiers, time.perf_counter() - t0

    def _agree(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on every rank; Fallback on all of them, with the first rank's problem, when
        it failed on any."""
        result, problem = None, None
        try:
            result = fn()
        except Fallback as exc:
            problem = str(exc)
        except Exception as exc:  # DCP's and torch's own: the tier is lost, the disk stays
            problem = f"rank {self.rank}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        problems = [p for p in self.comm.all_gather(problem) if p]
        if problems:
            raise Fallback(problems[0])
        return result

    def _restore(self, choice: ms.Choice, nodes: list[str]) -> dict[int, str]:
        assert choice.step is not None
        step = choice.step

        def my_layouts() -> dict[int, mload.Layout]:
            out = {}
            for old, (holder, kind) in choice.sources.items():
                if holder == self.rank:
                    data = ms.read_layout(self.store, step, kind, old)
                    if zlib.crc32(data) != choice.layout_crcs[old]:
                        raise Fallback(f"rank {old}: CRC mismatch of its {kind} layout of step {step} on rank"
                                       f" {holder}'s node")
                    out[old] = mload.parse_layout(data)
            return out

        layouts = {old: lay for share in self.comm.all_gather(self._agree(my_layouts)) for old, lay in share.items()}

        def plan() -> tuple[Any, dict, dict, list, set[int]]:
            metadata, holders = mload.metadata_of(layouts)
            for module, optimizer in self.parts:
                allocate_optimizer_state(module, optimizer, metadata)
            model_sd, optim_sd, keys = _state_dicts(self.parts)
            state = {"model": model_sd, "optim": optim_sd}
            storage = {index: ms.pick(olds, rank=self.rank, sources=choice.sources, nodes=nodes)
                       for index, olds in holders.items()}
            needs = mload.needed(state, metadata, storage)
            if choice.from_world == self.world:
                needs.add(self.rank)  # its RNG streams are in its own shard
            return metadata, storage, state, keys, needs

        metadata, storage, state, keys, needs = self._agree(plan)
        moves, tiers = ms.transfers(self.comm.all_gather(sorted(needs)), choice.sources, nodes)
        shards = self._agree(lambda: self._gather_shards(choice, needs, moves))

        def load() -> None:
            dcp.load(state, storage_reader=mload.MemoryReader(metadata, storage, shards), planner=SafeLoadPlanner(),
                     no_dist=True)
            set_parts(self.parts, keys, state)
            self.scheduler.load_state_dict(shards[min(shards)]["scheduler"])
            if choice.from_world == self.world:
                set_rng_state(shards[self.rank]["rng"])

        self._agree(load)
        return tiers

    def _gather_shards(self, choice: ms.Choice, needs: set[int],
                       moves: list[tuple[int, int, int]]) -> dict[int, dict[str, Any]]:
        """The shards this rank needs: read from its node's store, or received from the rank
        whose node holds them (`moves`, in the order every rank walks), each checked against
        its CRC in the commit record, then parsed as tensors and plain data only."""
        assert choice.step is not None
        step = choice.step
        read: dict[int, bytes] = {}

        def local(old: int) -> bytes:
            if old not in read:
                try:
                    read[old], _ = ms.read_shard(self.store, step, choice.sources[old][1], old)
                except OSError as exc:
                    read[old] = b""
                    print(f"memory tier: rank {old}'s shard could not be read ({exc})", flush=True)
            return read[old]

        got: dict[int, bytes] = {}
        remote = {old for old, _, to in moves if to == self.rank}
        for old in needs - remote:
            got[old] = local(old)
        for old, holder, to in moves:
            if holder == self.rank:
                data = local(old)
                dist.send(torch.tensor([len(data)], dtype=torch.int64), to, group=self.group)
                if data:
                    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), to, group=self.group)
            elif to == self.rank:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, holder, group=self.group)
                buf = torch.empty(int(size.item()), dtype=torch.uint8)
                if int(size.item()):
                    dist.recv(buf, holder, group=self.group)
                got[old] = buf.numpy().tobytes()
        for old, data in sorted(got.items()):
            holder, kind = choice.sources[old]
            if not data:
                raise Fallback(f"rank {old}: its {kind} shard on rank {holder}'s node could not be read")
            if zlib.crc32(data) != choice.crcs[old]:
                raise Fallback(f"rank {old}: CRC mismatch of its {kind} shard of step {step} on rank {holder}'s node")
        return {old: torch.load(io.BytesIO(data), weights_only=True) for old, data in got.items()}

    def close(self, *, discard: bool) -> None:
        """Finish the snapshot in flight; `discard`: the run is durable on disk (finished or
        stopped), this node's store is removed."""
        self.wait()
        self._thread.shutdown(wait=True)
        if discard:
            self.comm.barrier()
            if self.local_rank == 0 and not self.refused and not self._check():
                shutil.rmtree(self.store.parent, ignore_errors=True)

    def rolled_back(self, to_step: int) -> None:
        """Collective, before the rollback's disk checkpoints are removed: the snapshot in flight
        is finished, every node removes its snapshots newer than `to_step` (the abandoned
        trajectory), and later snapshots are of the next generation (the rollback's record in
        data_skips.json counts it at a later start)."""
        self.wait()
        if self.local_rank == 0 and not self.refused and not self._check():
            ms.remove_after(self.store, to_step)
        self.comm.barrier()
        self.generation += 1
