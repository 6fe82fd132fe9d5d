"""A DCP storage writer that checksums every file as it writes it.

The manifest records each file's size and CRC-32 (dtk.checkpoint.manifest). Reading every
file back after the save to compute them costs a second pass over the checkpoint; here the
CRC is updated with each buffer on its way to the file, so a save is one pass over the
data. The page cache writes back to the disk while the next buffers are hashed, so on a
disk slower than CRC-32 the hash costs next to nothing.

A large buffer is hashed in CHUNK pieces on a small thread pool while the calling thread
writes it (zlib's CRC releases the GIL), and the pieces' CRCs are joined as zlib's
crc32_combine does (`Crc.extend`): the file's CRC-32 is the one a single pass computes,
so manifests and their verification are unchanged.

The disk write is started as the data goes, too: after each large write the new range is
handed to sync_file_range(2) (SYNC_FILE_RANGE_WRITE, from a thread: it may block while the
device queue is full), so the disk writes while the next tensors are serialized and hashed.
Otherwise nothing reaches the disk before the file's fsync (the kernel starts writing back
only once a tenth of memory is dirty), and the save costs its CPU work plus the whole disk
write one after the other. The fsync at the end of each file still decides durability.

A file counts as hashed only if it was written front to back (no seek) and its size on
disk equals the bytes hashed; any other file is left out of `hashed()`, and the saver
reads it back instead - the manifest is right either way.
"""

from __future__ import annotations

import ctypes
import os
import threading
import zlib
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from dtk.checkpoint.manifest import CHECKSUM

CHUNK = 8 << 20  # bytes per piece hashed on its own
POLY = 0xEDB88320  # CRC-32 (zlib), reflected


def _times(matrix: list[int], vector: int) -> int:
    """A GF(2) 32x32 matrix (matrix[i]: the image of bit i) times a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, column) for column in matrix]


def _zeros_operator(num_bytes_log2: int) -> list[int]:
    """The operator that advances a CRC register over 2**num_bytes_log2 zero bytes."""
    operator = [POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3 + num_bytes_log2):  # 8 bits per byte, then doubling
        operator = _square(operator)
    return operator


SKIP_CHUNK = _zeros_operator(CHUNK.bit_length() - 1)
assert 1 << (CHUNK.bit_length() - 1) == CHUNK, "CHUNK must be a power of two"


class Crc:
    """A running CRC-32 that takes pieces hashed elsewhere: `extend(crc, n)` appends a piece
    whose own CRC (from 0) is `crc`; only whole CHUNK pieces can be appended so."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def extend(self, piece_crc: int) -> None:
        # crc(A + B) = shift(crc(A), len(B)) ^ crc(B), for B of CHUNK bytes
        self.value = _times(SKIP_CHUNK, self.value) ^ piece_crc


_POOL = ThreadPoolExecutor(max_workers=max(2, min(8, len(os.sched_getaffinity(0)))), thread_name_prefix="dtk-crc")


def _sync_file_range():
    """Linux's sync_file_range(2), or None where the C library lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start writing the dirty pages of the range back, do not wait
_WRITEBACK = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtk-writeback")


class HashingStream:
    """A binary file opened for writing that updates a CRC-32 with every write."""

    def __init__(self, raw, *, kick: bool = True) -> None:
        self.raw = raw
        self.kick = kick  # False: not a local file (an object store's upload), no write-back to start
        self.crc = Crc()
        self.size = 0
        self.sequential = True
        self._kicked = 0  # bytes from the start whose write-back was started
        self._kicks: list = []

    def _kick(self) -> None:
        """Start the disk write of what was written since the last kick, in the background:
        the disk works while the next buffers are serialized and hashed, instead of all of
        it waiting for the file's fsync (the kernel alone would start only once a tenth of
        memory is dirty). The fsync at the end still decides durability."""
        if _SYNC_FILE_RANGE is None:
            return
        end = self.raw.tell()
        if end - self._kicked < CHUNK:
            return
        fd, start, self._kicked = self.raw.fileno(), self._kicked, end
        self._kicks = [kick for kick in self._kicks if not kick.done()]
        self._kicks.append(_WRITEBACK.submit(_SYNC_FILE_RANGE, fd, start, end - start, _WRITE))

    def close(self) -> None:
        for kick in self._kicks:  # the descriptor stays open until its kicks are done
            kick.result()
        self._kicks.clear()
        self.raw.close()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        whole = (view.nbytes // CHUNK) * CHUNK
        # The CHUNK pieces are hashed by the pool while this thread writes; the buffer is
        # not released before they are done (the caller may reuse it after we return).
        pieces = [_POOL.submit(zlib.crc32, view[i : i + CHUNK]) for i in range(0, whole, CHUNK)] if whole else []
        written = self.raw.write(view)
        written = view.nbytes if written is None else written
        done = 0
        if pieces and written == view.nbytes:
            for piece in pieces:
                self.crc.extend(piece.result())
            done = whole
        else:
            for piece in pieces:
                piece.result()
        self.crc.update(view[done:written])
        self.size += written
        if written >= CHUNK and self.kick:
            self._kick()
        return written

    def seek(self, *args) -> int:
        self.sequential = False  # bytes may be overwritten: the running CRC no longer describes the file
        return self.raw.seek(*args)

    def truncate(self, *args) -> int:
        self.sequential = False
        return self.raw.truncate(*args)

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, closed, ...
        return getattr(self.raw, name)

    def __enter__(self) -> HashingStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HashRecords:
    """name -> {"size", "crc32"} of each file a DCP file system wrote and hashed, shared by the
    local and the object-store file systems below. DCP may write files from several threads."""

    def __init__(self) -> None:
        self._hashed: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def record(self, name: str, hashing: HashingStream, *, stored_size: int) -> None:
        """Keep the file's hash when it was written in one pass and is whole where it lies."""
        ok = hashing.sequential and stored_size == hashing.size
        with self._lock:
            if ok:
                self._hashed[name] = {"size": hashing.size, CHECKSUM: f"{hashing.crc.value:08x}"}
            else:
                self._hashed.pop(name, None)

    def renamed(self, name: str, new_name: str) -> None:
        """DCP writes .metadata under a temporary name, then renames it."""
        with self._lock:
            entry = self._hashed.pop(name, None)
            if entry is not None:
                self._hashed[new_name] = entry

    def hashed(self) -> dict[str, dict[str, Any]]:
        """name -> {"size", "crc32"} of each file written and hashed so far."""
        with self._lock:
            return dict(self._hashed)


class HashingFileSystem(FileSystem):
    """DCP's local file system, with every file it writes checksummed on the way."""

    def __init__(self) -> None:
        super().__init__()
        self.records = HashRecords()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            hashing = HashingStream(raw)
            try:
                yield hashing
            finally:
                hashing.close()  # waits for its write-back kicks before the descriptor closes
        self.records.record(Path(path).name, hashing, stored_size=os.stat(path).st_size)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self.records.renamed(Path(path).name, Path(new_path).name)

    def hashed(self) -> dict[str, dict[str, Any]]:
        return self.records.hashed()


class HashingWriter(FileSystemWriter):
    """`dcp.FileSystemWriter` whose files are checksummed as they are written (`hashed()`).

    torch.save, which DCP writes each tensor with, computes a zip CRC-32 of every record:
    one more pass over the data, which the manifest's CRC makes redundant. It is turned off
    for the process (torch.serialization.set_crc32_options; torch.load does not need it):
    dtk's workers write nothing else with torch.save that a zip tool would read."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.hashing = HashingFileSystem()
        self.fs = self.hashing  # what FileSystemWriter writes through
        torch.serialization.set_crc32_options(False)

    def hashed(self) -> dict[str, dict[str, Any]]:
        return self.hashing.hashed()


class HashingFsspecFileSystem(FsspecFileSystem):
    """DCP's fsspec file system (an object store), every file it writes checksummed on the
    way; its size is asked of the store once the upload is done."""

    def __init__(self, fs: Any) -> None:
        super().__init__()
        self.fs = fs
        self.records = HashRecords()

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        return path  # the store is given, with its endpoint and credentials

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            hashing = HashingStream(raw, kick=False)
            yield hashing
        assert self.fs is not None
        self.records.record(os.path.basename(os.fspath(path)), hashing, stored_size=self.fs.size(os.fspath(path)))

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # .metadata's temp object: a copy and a delete in a store
        self.records.renamed(os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path)))

    def hashed(self) -> dict[str, dict[str, Any]]:
        return self.records.hashed()


class HashingFsspecWriter(FsspecWriter):
    """`HashingWriter` for a folder of an object store (`dtk.common.storage.FsspecStorage`):
    the files are checksummed as they are uploaded. No fsync: an object exists once its
    upload completed."""

    def __init__(self, store: Any, **kwargs: Any) -> None:
        super().__init__(store.root, sync_files=False, **kwargs)
        self.hashing = HashingFsspecFileSystem(store.fs)
        self.fs = self.hashing  # type: ignore[assignment]  # FileSystemWriter's annotation: the local one
        torch.serialization.set_crc32_options(False)

    def hashed(self) -> dict[str, dict[str, Any]]:
        return self.hashing.hashed()
