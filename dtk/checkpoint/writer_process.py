"""checkpoint.async_mode=process: an async save's shards written by DCP's checkpoint
process (one per rank, spawned at the first save, its own gloo group), so neither the
serialization nor the writes share the training process's GIL.

What it costs against the thread mode (dtk.checkpoint.hashing): DCP pickles the storage
writer into that process and hands back only the checkpoint's metadata, so the CRCs cannot
be computed while writing; the writer is DCP's own, and rank 0 reads the files back for
the manifest (the saver's read-back path). The first save of a process also waits for the
spawn (interpreter, imports, process group).

DCP keeps that process in a module global and never replaces it: once it died (killed,
out of memory), every later save would fail. After any failed save every rank stops its
process (the saver agrees on failures, so all ranks do it at the same save) and the next
save spawns fresh ones together.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import _async_process_executor as executor


def writer(path: Path, *, thread_count: int) -> FileSystemWriter:
    # Files are fsynced by the checkpoint process before it answers: the manifest counts them.
    return FileSystemWriter(str(path), sync_files=True, thread_count=thread_count)


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

