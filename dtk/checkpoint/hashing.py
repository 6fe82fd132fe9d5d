"""A DCP storage writer that checksums every file as it writes it.

The manifest records each file's size and CRC-32 (dtk.checkpoint.manifest). Reading every
file back after the save to compute them costs a second pass over the checkpoint; here the
CRC is updated with each buffer on its way to the file, so a save is one pass over the
data. The page cache writes back to the disk while the next buffers are hashed, so on a
disk slower than CRC-32 the hash costs next to nothing.

A file counts as hashed only if it was written front to back (no seek) and its size on
disk equals the bytes hashed; any other file is left out of `hashed()`, and the saver
reads it back instead - the manifest is right either way.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from dtk.checkpoint.manifest import CHECKSUM


class HashingStream:
    """A binary file opened for writing that updates a CRC-32 with every write."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.crc = 0
        self.size = 0
        self.sequential = True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        written = view.nbytes if written is None else written
        self.crc = zlib.crc32(view[:written], self.crc)
        self.size += written
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
        self.raw.close()


class HashingFileSystem(FileSystem):
    """DCP's local file system, with every file it writes checksummed on the way."""

    def __init__(self) -> None:
        super().__init__()
        self._hashed: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = HashingStream(raw)
            yield stream
        name = Path(path).name
        ok = stream.sequential and os.stat(path).st_size == stream.size
        with self._lock:
            if ok:
                self._hashed[name] = {"size": stream.size, CHECKSUM: f"{stream.crc:08x}"}
            else:
                self._hashed.pop(name, None)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata as a temp file, then renames it
        with self._lock:
            entry = self._hashed.pop(Path(path).name, None)
            if entry is not None:
                self._hashed[Path(new_path).name] = entry

    def hashed(self) -> dict[str, dict[str, Any]]:
        """name -> {"size", "crc32"} of each file written and hashed so far."""
        with self._lock:
            return dict(self._hashed)


class HashingWriter(FileSystemWriter):
    """`dcp.FileSystemWriter` whose files are checksummed as they are written (`hashed()`)."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = HashingFileSystem()

    def hashed(self) -> dict[str, dict[str, Any]]:
        return self.fs.hashed()
