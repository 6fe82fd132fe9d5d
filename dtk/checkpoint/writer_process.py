"""checkpoint.async_mode=process: an async save's shards written by DCP's checkpoint
process (one per rank, spawned at the first save, its own gloo group), so neither the
serialization nor the writes nor the checksums share the training process's GIL or core.

The training process does one thing per save: the stager copies the state once into shared
memory buffers kept from one save to the next, and the staged tensors reach the checkpoint
process as handles, not copies. DCP pickles the storage writer (`ProcessWriter`) into that
process, where it checksums every file as it writes it (dtk.checkpoint.hashing) and leaves
the sizes and CRCs in a small report file of this rank's own (a private temp folder, not
the run directory); the training process reads that report instead of the shards, so no
byte of the checkpoint is read back there. A file the report lacks (a write out of order)
is still read back by the saver, so the manifest is right either way. The first save of a
process also waits for the spawn (interpreter, imports, process group).

The checkpoint process runs at the lowest CPU priority (nice 19, all its threads: `NICE`):
where the node's cores are all busy, the scheduler gives the CPU to the training step first
and the write takes what is left - the save takes longer in wall time, the steps it
overlaps are not slowed by it. Where cores are free (a GPU node) it changes nothing.

DCP keeps that process in a module global and never replaces it: once it died (killed,
out of memory), every later save would fail. After any failed save every rank stops its
process (the saver agrees on failures, so all ranks do it at the same save) and the next
save spawns fresh ones together.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import _async_process_executor as executor

from dtk.checkpoint.hashing import HashingFileSystem, HashingWriter

NICE = 19  # the checkpoint process's CPU priority: the lowest, below the training step's


def _lower_priority() -> None:
    """Every thread of this process (Linux's nice is per thread) at NICE; new threads inherit it."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < NICE:
                os.setpriority(os.PRIO_PROCESS, tid, NICE)
        except OSError:  # a thread that ended meanwhile, or a system that refuses: only a priority
            pass


class ProcessWriter(HashingWriter):
    """HashingWriter that works in DCP's checkpoint process: it hashes there and writes what
    it hashed to `report`, which `hashed()` reads in the training process."""

    def __init__(self, path: str | os.PathLike, *, report: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.report = report
        self._parent_pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:  # the file system's lock does not pickle
        state = dict(self.__dict__)
        state.pop("hashing")
        state.pop("fs")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.hashing = HashingFileSystem()
        self.fs = self.hashing
        torch.serialization.set_crc32_options(False)  # as in HashingWriter: the manifest's CRC suffices
        if os.getpid() != state["_parent_pid"]:  # unpickled in the checkpoint process (each request)
            _lower_priority()

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)  # FileSystemWriter writes before it returns
        done.wait()
        self._write_report()
        return done

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)  # rank 0: .metadata, hashed too
        self._write_report()

    def _write_report(self) -> None:
        tmp = self.report.with_name(self.report.name + ".tmp")
        tmp.write_text(json.dumps(self.hashing.hashed()))
        os.replace(tmp, self.report)

    def hashed(self) -> dict[str, dict[str, Any]]:
        """name -> {"size", "crc32"} of each file the checkpoint process wrote and hashed
        (the training process's view; nothing when the report is missing or unreadable)."""
        try:
            entries = json.loads(self.report.read_text())
        except (OSError, ValueError):
            return {}
        finally:
            self.report.unlink(missing_ok=True)
        return entries if isinstance(entries, dict) else {}


def writer(path: Path, *, report: Path, thread_count: int) -> ProcessWriter:
    # Files are fsynced by the checkpoint process before it answers: the manifest counts them.
    report.unlink(missing_ok=True)  # a report of an earlier save of the same step
    return ProcessWriter(str(path), report=report, sync_files=True, thread_count=thread_count)


def pid() -> int | None:
    """The pid of this rank's checkpoint process, None before the first save."""
    proc = executor._CHECKPOINT_PROCESS
    return proc._save_process.pid if proc is not None else None


def discard() -> None:
    """Stop this rank's checkpoint process (nothing in flight); the next save spawns one."""
    proc, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    if proc is None:
        return
    child = proc._save_process
    if child.is_alive():
        child.kill()
    child.join(timeout=30)
    proc._process_pipe.close()
