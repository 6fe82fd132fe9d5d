"""A DCP storage reader that checksums the files it reads, so a resume reads each byte once.

Resuming used to read every file of the checkpoint for its CRC-32 and then let DCP read it
all again: for a large checkpoint, two passes over the storage before the first step. This
reader reads each file a rank needs front to back, in one pass, hashing every byte on the
way (gaps between the items it needs too), and hands each item to DCP from the bytes just
read. After the load the ranks pool the CRCs they computed; only the files that no rank
read whole (another layout's shards read in part, the small files) are read for their CRC
alone (dtk.checkpoint.load).

A rank that needs under half of a file reads just its items (seeking) and leaves the
file's CRC to the check after the load: reading a mostly unneeded file whole would cost
more than reading it once for its CRC.

A file whose bytes do not match the manifest is a corrupt checkpoint whatever DCP made of
it: a flipped byte in a tensor loads quietly, one in a record header fails in torch.load.
So a failure while loading still finishes the file's CRC; `mismatches` then names the
corruption, which the loader reports as a rejection rather than as a load failure.
"""

from __future__ import annotations

import io
import os
import zlib
from collections import defaultdict
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from dtk.checkpoint.manifest import CHECKSUM, CHUNK

WHOLE_SHARE = 0.5  # read (and hash) a file whole when the rank needs at least this share of it


class HashingReader(FileSystemReader):
    """`dcp.FileSystemReader` that computes the CRC-32 of every file it reads whole (`crcs`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.crcs: dict[str, str] = {}  # file name -> CRC-32 of its bytes, for files read whole

    def mismatches(self, manifest: dict[str, Any]) -> list[str]:
        """The files this rank read whole whose CRC differs from the manifest's."""
        return [f"{name} {CHECKSUM} {crc}, manifest says {manifest['files'][name].get(CHECKSUM)}"
                for name, crc in sorted(self.crcs.items())
                if name in manifest["files"] and manifest["files"][name].get(CHECKSUM) != crc]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, dict[tuple[int, int], list]] = defaultdict(lambda: defaultdict(list))
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file[info.relative_path][(info.offset, info.length)].append(req)
        for name, items in per_file.items():
            self._read_file(name, items, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, items: dict[tuple[int, int], list], planner: LoadPlanner) -> None:
        path = os.path.join(self.path, name)
        spans = sorted(items)
        with open(path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            whole = sum(length for _, length in spans) >= WHOLE_SHARE * size
            crc, pos, failure = 0, 0, None
            for offset, length in spans:
                if offset < pos:  # items that overlap: not a file DCP writes; no CRC from this pass
                    whole = False
                if whole:
                    crc = _hash_span(fh, pos, offset, crc)  # the gap before the item
                else:
                    fh.seek(offset)
                data = _read_exactly(fh, length)
                if whole:
                    crc = zlib.crc32(data, crc)
                pos = offset + length
                if failure is None:
                    try:
                        for req in items[(offset, length)]:
                            self._load(req, data, planner)
                    except Exception as exc:  # finish the CRC first: a corrupt file explains it
                        if not whole:
                            raise
                        failure = exc
                del data
            if whole:
                crc = _hash_span(fh, pos, size, crc)
                self.crcs[name] = f"{crc:08x}"
        if failure is not None:
            raise failure

    def _load(self, req, data: bytearray, planner: LoadPlanner) -> None:
        """One read item from its bytes: what FileSystemReader does with a file slice."""
        info = self.storage_data[req.storage_index]
        stream = self.transforms.transform_load_stream(req, info.transform_descriptors or (), io.BytesIO(data))
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            return
        if not stream.seekable():
            stream = io.BytesIO(stream.read(-1))
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise RuntimeError(f"{req.storage_index}: stored size {tuple(tensor.size())}, expected {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def _read_exactly(fh, length: int) -> bytearray:
    data = bytearray(length)
    view = memoryview(data)
    got = 0
    while got < length:
        n = fh.readinto(view[got:])
        if not n:
            raise OSError(f"{fh.name}: ends at {fh.tell()} bytes, a record needs {length - got} more")
        got += n
    return data


def _hash_span(fh, start: int, end: int, crc: int) -> int:
    """Extend `crc` over the file's bytes [start, end), read from the current position."""
    buf = bytearray(min(CHUNK, max(0, end - start)))
    view = memoryview(buf)
    left = end - start
    while left > 0:
        n = fh.readinto(view[: min(left, len(buf))])
        if not n:
            raise OSError(f"{fh.name}: ends {left} bytes before {end}")
        crc = zlib.crc32(view[:n], crc)
        left -= n
    return crc
