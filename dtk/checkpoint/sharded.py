"""Sharded checkpoints with torch.distributed.checkpoint, committed by a manifest.

Layout of one checkpoint (see dtk.rundir):

    checkpoints/step_00000050/
        __0_0.distcp ...      DCP shards: model and optimizer, keys independent of the scheme
        .metadata             DCP's index
        rng_00000.pt ...      each rank's RNG states
        trainer.json          step, data position, scheduler, world size, config hash
        manifest.json         written last, atomically: the checkpoint exists once this does
                              (format and verification: dtk.checkpoint.manifest)

Model and optimizer go through `get_state_dict`/`set_state_dict` with flattened optimizer
state, so every key is a parameter's original name (no `module.` prefix, no sharding, no
pipeline stage): a checkpoint written under one scheme and world size loads under another.
A rank may hold several model parts (pipeline stages), each with its own optimizer.

A save runs in three phases; only the first blocks training:

    1. main thread, every rank: wait for the previous save; create the folder; write this
       rank's RNG file (and rank 0 trainer.json); stage model and optimizer state into
       CPU buffers kept from one save to the next (`DefaultStager`); start `dcp.async_save`.
    2. DCP's thread: plan and write the shards, rank 0 writes `.metadata`. When it returns on
       any rank, every rank's files are on disk (DCP gathers the write results first).
    3. our finisher thread, every rank: checksum a share of the folder's files, gather the
       shares, and rank 0 commits the manifest - then prunes and logs `checkpoint_saved`.

Phases 2 and 3 talk over a gloo group of their own, so they never interleave with the
training step's collectives (and work with NCCL training). A synchronous save runs the
same phases and waits for them.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from dtk.checkpoint import manifest as mf
from dtk.rundir import write_json_atomic

TRAINER_STATE = "trainer.json"
WRITE_THREADS = 1  # per rank; more did not write faster on the disks measured (docs/benchmarks.md)
FORMAT_VERSION = mf.FORMAT_VERSION

Parts = list[tuple[torch.nn.Module, torch.optim.Optimizer]]
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def rng_file(rank: int) -> str:
    return f"rng_{rank:05d}.pt"


def _state_dicts(parts: Parts) -> tuple[dict[str, Any], dict[str, Any], list[tuple[set, set]]]:
    """Merged model and optimizer state of all parts, plus each part's own keys."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    keys = []
    for module, optimizer in parts:
        m, o = get_state_dict(module, optimizer, options=_OPTIONS)
        assert not (m.keys() & model_sd.keys()), "model parts share parameter names"
        model_sd.update(m)
        optim_sd.update(o)
        keys.append((set(m), set(o)))
    return model_sd, optim_sd, keys


class Comm:
    """The checkpoint's own process group (gloo), or nothing in a single process."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank() if group is not None else 0
        self.world_size = dist.get_world_size() if group is not None else 1

    @staticmethod
    def create() -> Comm:
        if not dist.is_initialized():
            return Comm(None)
        # Collective: every rank creates it at the same point (the CheckpointManager's __init__).
        return Comm(dist.new_group(backend="gloo"))

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """rank 0's `obj` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one."""
        if self.group is None:
            return bool(flag)
        t = torch.tensor([int(bool(flag))])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


class Saver:
    """Writes checkpoints, at most one in flight. Every rank holds one; `start`, `wait` and
    `close` are collective."""

    def __init__(self, comm: Comm, *, asynchronous: bool, on_commit: Callable[[dict[str, Any]], None]) -> None:
        self.comm = comm
        self.asynchronous = asynchronous
        self.on_commit = on_commit  # rank 0, finisher thread, right after the manifest is written
        self._stager = (
            DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                         use_async_staging=False, use_non_blocking_copy=False))
            if asynchronous
            else None
        )
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtk-ckpt")
        self._pending: Future | None = None

    def _writer(self, path: Path) -> dcp.FileSystemWriter:
        # Files are fsynced before the manifest can count them.
        return dcp.FileSystemWriter(str(path), sync_files=True, thread_count=WRITE_THREADS)

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def start(self, path: Path, *, parts: Parts, trainer_state: dict[str, Any], header: dict[str, Any]) -> float:
        """Begin saving; returns the seconds training was blocked (including the wait for
        the previous save)."""
        t0 = time.perf_counter()
        self.wait()
        rank = self.comm.rank
        if rank == 0:
            if path.exists():  # left by a save that was killed before its manifest
                shutil.rmtree(path)
            path.mkdir(parents=True)
        self.comm.barrier()
        torch.save(_rng_state(), path / rng_file(rank))
        if rank == 0:
            write_json_atomic(path / TRAINER_STATE, trainer_state)
        model_sd, optim_sd, _ = _state_dicts(parts)
        state = {"model": model_sd, "optim": optim_sd}
        if self.asynchronous:
            written = dcp.async_save(state, storage_writer=self._writer(path), process_group=self.comm.group,
                                     async_stager=self._stager, no_dist=self.comm.group is None)
        else:
            dcp.save(state, storage_writer=self._writer(path), process_group=self.comm.group,
                     no_dist=self.comm.group is None)
            written = Future()
            written.set_result(None)
        blocked = time.perf_counter() - t0
        self._pending = self._finisher.submit(self._finish, path, written, header, t0, blocked)
        if not self.asynchronous:
            self.wait()
            blocked = time.perf_counter() - t0
        return blocked

    def _finish(
        self, path: Path, written: Future, header: dict[str, Any], t0: float, blocked: float
    ) -> dict[str, Any] | None:
        written.result()
        # Every rank checksums a share of the files (the folder is on storage all ranks see).
        # rank 0 lists, so that every rank agrees on the shares even where listings lag.
        names = self.comm.broadcast(mf.payload_files(path) if self.comm.rank == 0 else None)
        mine = {name: mf.describe_file(path / name) for name in names[self.comm.rank :: self.comm.world_size]}
        files: dict[str, Any] = {}
        for share in self.comm.all_gather(mine):
            files.update(share)
        if self.comm.rank != 0:
            return None
        manifest = {
            "format": FORMAT_VERSION,
            **header,
            "rng_files": [rng_file(r) for r in range(self.comm.world_size)],
            "files": files,
            "save_seconds": round(time.perf_counter() - t0, 4),
            "blocked_seconds": round(time.perf_counter() - t0 if not self.asynchronous else blocked, 4),
            "time": round(time.time(), 3),
        }
        mf.commit(path, manifest)  # the commit point
        self.on_commit(manifest)
        return manifest

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._finisher.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()


def verify(comm: Comm, path: Path) -> dict[str, Any]:
    """Collective: the manifest of a checkpoint whose files all match it, else mf.Rejected on
    every rank. Ranks share the checksum reading."""
    found: tuple[dict[str, Any] | None, str] = (None, "")
    if comm.rank == 0:
        try:
            manifest = mf.read_manifest(path)
            problems = mf.check_sizes(path, manifest)
            found = (manifest, mf.summarize(problems)) if problems else (manifest, "")
        except mf.Rejected as exc:
            found = (None, str(exc))
    manifest, reason = comm.broadcast(found)
    if manifest is None or reason:
        raise mf.Rejected(reason)
    names = sorted(manifest["files"])
    problems = mf.check_checksums(path, manifest, names[comm.rank :: comm.world_size])
    every = [p for share in comm.all_gather(problems) for p in share]
    if every:
        raise mf.Rejected(mf.summarize(every))
    return manifest


def load(path: Path, *, parts: Parts, comm: Comm) -> tuple[dict[str, Any], bool]:
    """Collective: load model and optimizer (resharded to the current layout); return the
    trainer state and whether this rank's RNG was restored (only when the world size is
    unchanged: a rank's stream means nothing to another layout)."""
    model_sd, optim_sd, keys = _state_dicts(parts)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path), process_group=comm.group, no_dist=comm.group is None)
    for (module, optimizer), (mkeys, okeys) in zip(parts, keys, strict=True):
        set_state_dict(
            module,
            optimizer,
            model_state_dict={k: state["model"][k] for k in mkeys},
            optim_state_dict={k: state["optim"][k] for k in okeys},
            options=_OPTIONS,
        )
    trainer_state = json.loads((path / TRAINER_STATE).read_text())
    restored = False
    rng = path / rng_file(comm.rank)
    if trainer_state["world_size"] == comm.world_size and rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
        restored = True
    return trainer_state, restored


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
