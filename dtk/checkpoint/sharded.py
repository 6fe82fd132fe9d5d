"""Sharded checkpoints with torch.distributed.checkpoint, committed by a manifest.

Layout of one checkpoint (see dtk.common.rundir):

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

    1. main thread, every rank: wait for the previous save; create the folder; take this
       rank's RNG state (and rank 0 the trainer state); start staging model and optimizer state
       into host buffers kept from one save to the next (DCP's `DefaultStager`, copying without
       the GIL: dtk.checkpoint.staging; pinned memory and a copy stream of its own on a GPU)
       and start `dcp.async_save`.
    1b. the stager's thread copies the state while training goes on; the next optimizer
       step (and the next forward, where the model has buffers a forward may change) waits
       for the copy first (`staged`, hooked by the CheckpointManager), so the checkpoint
       holds the state of the step it names.
    2. DCP's thread: plan and write the shards, rank 0 writes `.metadata`. When it returns on
       any rank, every rank's files are on disk (DCP gathers the write results first).
    3. our finisher thread, every rank: write and fsync the RNG file (rank 0 trainer.json
       too) while DCP writes the shards, wait for DCP, gather the sizes and CRCs of the files each rank
       wrote (computed while writing: dtk.checkpoint.hashing), and rank 0 commits the
       manifest - then prunes and logs `checkpoint_saved`.

Phases 2 and 3 talk over a gloo group of their own, so they never interleave with the
training step's collectives (and work with NCCL training). A synchronous save runs the
same phases and waits for them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from dtk.checkpoint import manifest as mf
from dtk.checkpoint import writer_process
from dtk.checkpoint.hashing import HashingFsspecWriter, HashingWriter
from dtk.checkpoint.rng import rng_state, save_rng_to
from dtk.checkpoint.staging import stager
from dtk.common.rundir import TRAINER_STATE
from dtk.common.storage import FsspecStorage, LocalStorage, Storage
from dtk.mesh.groups import new_group
from dtk.models.ties import checkpoint_keys

WRITE_THREADS = 1  # per rank; more did not write faster on the disks measured (docs/benchmarks.md)
FORMAT_VERSION = mf.FORMAT_VERSION
COMMIT_DELAY_ENV = "DTK_TEST_COMMIT_DELAY_S"
"""Seconds rank 0 waits before each commit: for tests of a save that outlasts the time-limit
signal's lead (tests/test_faults.py). Unset in real runs."""

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
        checkpoint_keys(module, m, o)  # a tied weight once, under its first name
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
        return Comm(new_group(backend="gloo"))  # the world's timeout: a peer hung in a save is seen then

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


class SaveFailed(Exception):
    """A save did not commit; every rank raises it with the same cause. The folder has no
    manifest: it never counts, and the last committed checkpoint is untouched."""


def cause(exc: BaseException, *, rank: int | None = None) -> str:
    """`OSError: [Errno 28] No space left on device` in one line; for DCP's gathered
    failure, the first rank's own exception."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict) and failures:
        rank, exc = sorted(failures.items())[0]
        if isinstance(exc, tuple):  # (exception, traceback) in some torch versions
            exc = exc[0]
    text = " ".join(str(exc).split())[:300]
    where = f"rank {rank}: " if rank is not None else ""
    return f"{where}{type(exc).__name__}: {text}"


class Saver:
    """Writes checkpoints, at most one in flight. Every rank holds one; `start`, `wait` and
    `close` are collective."""

    def __init__(self, comm: Comm, *, asynchronous: bool, on_commit: Callable[[dict[str, Any]], None],
                 process: bool = False) -> None:
        self.comm = comm
        self.asynchronous = asynchronous
        # checkpoint.async_mode=process: DCP's checkpoint process writes (dtk.checkpoint.writer_process)
        self.process = asynchronous and process
        assert not self.process or comm.group is not None, "the checkpoint process needs a process group"
        # where the checkpoint process reports the sizes and CRCs of the files it wrote (this rank's own)
        self._reports = Path(tempfile.mkdtemp(prefix="dtk-ckpt-crc-")) if self.process else None
        self.on_commit = on_commit  # rank 0, finisher thread, right after the manifest is written
        gpu = torch.cuda.is_available()
        self._stager = (
            # Shared memory for the checkpoint process: the staged tensors reach it as handles, not copies.
            stager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=self.process,
                                  use_async_staging=True, use_non_blocking_copy=gpu))
            if asynchronous
            else None
        )
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtk-ckpt")
        self._pending: Future | None = None
        self._staging: Future | None = None  # the copy of the state in flight (async saves)
        # Clock readings of the save in flight: "copy_from", "copied" (the copy's start and
        # end), "wait_from" (when `staged` began to wait for it).
        self._times: dict[str, float] = {}

    def staged(self) -> None:
        """Block until the state of the save in flight is copied (local, no collective): before
        anything changes the state in place. A failed copy fails the save (reported by `wait`)."""
        staging, self._staging = self._staging, None
        if staging is None:
            return
        if not staging.done():
            self._times["wait_from"] = time.perf_counter()
            with contextlib.suppress(Exception):
                staging.result()

    @property
    def staging(self) -> bool:
        """Whether a copy of the state is in flight (`staged` would wait for it)."""
        return self._staging is not None

    def _writer(self, path: Path | Storage) -> Any:
        if isinstance(path, FsspecStorage):  # an object store (checkpoint.dir=s3://...): uploaded, hashed on the way
            assert self._reports is None, "checkpoint.async_mode=process writes local files only"
            return HashingFsspecWriter(path, thread_count=WRITE_THREADS)
        assert isinstance(path, Path), path  # Saver.start hands a local folder over as a Path
        if self._reports is not None:  # checksummed as written, in the checkpoint process
            return writer_process.writer(path, report=self._reports / f"{path.name}.json", thread_count=WRITE_THREADS)
        # Files are fsynced before the manifest can count them, and checksummed as written.
        return HashingWriter(str(path), sync_files=True, thread_count=WRITE_THREADS)

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def start(self, path: Path | Storage, *, parts: Parts, trainer_state: dict[str, Any], header: dict[str, Any],
              replace_committed: bool = False) -> float:
        """Begin saving; returns the seconds training was blocked (including the wait for
        the previous save). A folder of the same step left by a killed save is replaced; a
        committed one only when `replace_committed` (it failed verification on resume).

        A failure (no space, an I/O error, a read-only mount) raises SaveFailed on every
        rank, here or from `wait`; the folder is left without a manifest, so it never counts."""
        t0 = time.perf_counter()
        self.wait()
        rank = self.comm.rank
        path = path.path if isinstance(path, LocalStorage) else path
        store = path if isinstance(path, Storage) else LocalStorage(path)

        def prepare() -> None:
            if rank == 0:
                if store.exists(mf.MANIFEST) and not replace_committed:
                    raise FileExistsError(f"{store.url} is a committed checkpoint; no save replaces it")
                store.delete()  # left by a save that was killed before its manifest
                store.create()

        self._agree(prepare, everyone=False)  # also the barrier: the folder exists before anyone writes
        # The small files hold the state of now; the finisher writes them (and fsyncs them) off
        # the training thread, beside DCP's write.
        small = {rng_file(rank): rng_state()}
        if rank == 0:
            small[TRAINER_STATE] = json.loads(json.dumps(trainer_state, default=str))  # a copy: training goes on
        model_sd, optim_sd, _ = _state_dicts(parts)
        state = {"model": model_sd, "optim": optim_sd}
        writer = self._writer(path)
        self._times = {}
        try:  # DCP gathers every rank's write result: a failure raises on all of them
            if self.asynchronous:
                self._copy_after_queued_work()
                times = self._times
                times["copy_from"] = time.perf_counter()
                kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
                response = dcp.async_save(state, storage_writer=writer, process_group=self.comm.group,
                                          async_stager=self._stager, no_dist=self.comm.group is None,
                                          async_checkpointer_type=kind)
                # With a stager, DCP answers with both futures (a bare Future without one).
                assert isinstance(response, AsyncSaveResponse), type(response)
                self._staging, written = response.staging_completion, response.upload_completion
                self._staging.add_done_callback(lambda _: times.setdefault("copied", time.perf_counter()))
            else:
                dcp.save(state, storage_writer=writer, process_group=self.comm.group, no_dist=self.comm.group is None)
                written = Future()
                written.set_result(None)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise SaveFailed(cause(exc)) from exc
        blocked = time.perf_counter() - t0
        self._pending = self._finisher.submit(self._finish_or_discard, path, written, small, writer, header, t0,
                                              blocked)
        if not self.asynchronous:
            self.wait()
            blocked = time.perf_counter() - t0
        return blocked

    def _copy_after_queued_work(self) -> None:
        """On a GPU the stager copies on a stream of its own: it must first wait for the work
        already queued on this one (the optimizer step that produced the state). A device-side
        wait, no host sync; the host waits only where torch exposes no stream to order."""
        if not torch.cuda.is_available():
            return
        stream = getattr(self._stager, "_staging_stream", None)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        else:
            torch.cuda.current_stream().synchronize()

    def _agree(self, fn: Callable[[], Any], *, everyone: bool = True) -> Any:
        """Run `fn` (on every rank, or rank 0 alone), then agree: SaveFailed on every rank
        when it failed anywhere. Returns rank 0's result on every rank."""
        result, problem = None, None
        if everyone or self.comm.rank == 0:
            try:
                result = fn()
            except (Exception, CheckpointException) as exc:
                problem = cause(exc, rank=self.comm.rank if self.comm.world_size > 1 else None)
        if everyone:
            problems = [p for p in self.comm.all_gather(problem) if p]
            result = self.comm.broadcast(result)
        else:
            result, problem = self.comm.broadcast((result, problem))
            problems = [problem] if problem else []
        if problems:
            raise SaveFailed(problems[0])
        return result

    def _finish_or_discard(self, *args: Any) -> dict[str, Any] | None:
        try:
            return self._finish(*args)
        except SaveFailed:
            if self.process:  # every rank got the same failure: all stop their process, the next save starts anew
                writer_process.discard()
            raise

    def _finish(
        self, path: Path | Storage, written: Future, small: dict[str, Any], writer: Any, header: dict[str, Any],
        t0: float, blocked: float,
    ) -> dict[str, Any] | None:
        def small_files_then_shards() -> None:
            try:
                store = LocalStorage(path) if isinstance(path, Path) else path
                for name, content in small.items():
                    if name == TRAINER_STATE:
                        mf.write_json(store, name, content)
                    else:
                        save_rng_to(store, name, content)
            finally:  # DCP's thread is done with the group before this thread's collectives
                written.result()

        self._agree(small_files_then_shards)
        # Every rank describes the files it wrote: the DCP files were checksummed while they
        # were written; its small RNG file (and rank 0's trainer.json) are read back.
        hashed = writer.hashed() if isinstance(writer, HashingWriter) else {}
        own = [rng_file(self.comm.rank)] + ([TRAINER_STATE] if self.comm.rank == 0 else [])
        files: dict[str, Any] = {}
        for share in self.comm.all_gather(self._local(lambda: {**hashed, **{n: mf.describe(path, n) for n in own}})):
            if isinstance(share, str):
                raise SaveFailed(share)
            files.update(share)
        # Whatever no rank hashed (a file written out of order) rank 0 reads back.
        files.update(self._agree(lambda: {n: mf.describe(path, n) for n in mf.payload_files(path)
                                          if n not in files}, everyone=False))
        if self.comm.rank == 0 and os.environ.get(COMMIT_DELAY_ENV):  # a test hook: a slow save
            time.sleep(float(os.environ[COMMIT_DELAY_ENV]))
        times = dict(self._times)  # the copy ended before the write could: its readings are in
        copy_s = times["copied"] - times["copy_from"] if "copied" in times else None
        waited = max(0.0, times["copied"] - times["wait_from"]) if "copied" in times and "wait_from" in times else 0.0
        manifest = {
            "format": FORMAT_VERSION,
            **header,
            "rng_files": [rng_file(r) for r in range(self.comm.world_size)],
            "files": files,
            "save_seconds": round(time.perf_counter() - t0, 4),
            # what training waited: the save() call, then (async) for the copy to finish
            "blocked_seconds": round(time.perf_counter() - t0 if not self.asynchronous
                                     else blocked + waited, 4),
            # async: from the start of the copy to host memory to its end, overlapping training
            "staging_seconds": round(copy_s, 4) if copy_s is not None else None,
            "time": round(time.time(), 3),
        }
        self._agree(lambda: mf.commit(path, manifest), everyone=False)  # the commit point
        if self.comm.rank != 0:
            return None
        try:
            self.on_commit(manifest)
        except OSError as exc:  # the checkpoint is committed; pruning or the event could not be written
            print(f"checkpoint {path.name} committed, then: {cause(exc)}", file=sys.stderr, flush=True)
        return manifest

    def _local(self, fn: Callable[[], Any]) -> Any:
        """`fn()`, or the cause of its failure as a string (for gathering)."""
        try:
            return fn()
        except (Exception, CheckpointException) as exc:
            return cause(exc, rank=self.comm.rank if self.comm.world_size > 1 else None)

    def close(self) -> None:
        try:
            self.staged()
            self.wait()
        finally:
            self._finisher.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()
            if self.process:
                writer_process.discard()
            if self._reports is not None:
                shutil.rmtree(self._reports, ignore_errors=True)
