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

Nothing from a shard is unpickled as an object (dtk.checkpoint.trust): tensors load with
weights_only=True, and the few bytes items (the optimizer's param groups) only under the
keys dtk writes so, as plain values (dtk.checkpoint.safe). In a file read whole they are
parsed after the file's CRC matched the manifest, in the same pass; in a file read in part
they are parsed by the same safe loader and the file's CRC is checked after the load,
before any state is applied.
"""

from __future__ import annotations

import io
import os
import zlib
from collections import defaultdict
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from dtk.checkpoint.manifest import CHECKSUM, CHUNK, Rejected
from dtk.checkpoint.safe import SafeLoadPlanner, SafeReader
from dtk.checkpoint.trust import METADATA, bytes_key_refusal
from dtk.common.storage import Storage

WHOLE_SHARE = 0.5  # read (and hash) a file whole when the rank needs at least this share of it


class HashingReader(SafeReader):
    """`dcp.FileSystemReader` that computes the CRC-32 of every file it reads whole (`crcs`)
    and unpickles nothing but data (SafeReader)."""

    def __init__(self, path: str | os.PathLike | Storage, *, manifest: dict[str, Any]) -> None:
        super().__init__(path, manifest=manifest)
        self.crcs: dict[str, str] = {}  # file name -> CRC-32 of its bytes, for files read whole

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = super().read_metadata(*args, **kwargs)
        assert self.metadata_crc is not None
        self.crcs[METADATA] = self.metadata_crc  # checked against the manifest before it was parsed
        return metadata

    def mismatches(self, manifest: dict[str, Any]) -> list[str]:
        """The files this rank read whole whose CRC differs from the manifest's."""
        return [f"{name} {CHECKSUM} {crc}, manifest says {manifest['files'][name].get(CHECKSUM)}"
                for name, crc in sorted(self.crcs.items())
                if name in manifest["files"] and manifest["files"][name].get(CHECKSUM) != crc]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert isinstance(planner, SafeLoadPlanner), "dtk loads checkpoints with SafeLoadPlanner only"
        per_file: dict[str, dict[tuple[int, int], list]] = defaultdict(lambda: defaultdict(list))
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file[info.relative_path][(info.offset, info.length)].append(req)
        for name, items in per_file.items():
            if name not in self.manifest["files"]:  # parse_metadata refuses such an index: an invariant
                raise self.reject(f"{name} is not listed in manifest.json")
            self._read_file(name, items, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, items: dict[tuple[int, int], list], planner: LoadPlanner) -> None:
        spans = sorted(items)
        with self.storage.open_read(name) as fh:
            size = self.storage.size(name)
            whole = sum(length for _, length in spans) >= WHOLE_SHARE * size
            crc, pos, failure = 0, 0, None
            deferred: list[tuple[Any, bytes]] = []  # bytes items of a file read whole: parsed once it checks
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
                            if req.type == LoadItemType.BYTE_IO:
                                refusal = bytes_key_refusal(req.storage_index.fqn)
                                if refusal:
                                    raise self.reject(refusal)
                                if whole:
                                    deferred.append((req, data))
                                    continue
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
        if whole and self.crcs[name] != self.manifest["files"][name].get(CHECKSUM):
            return  # the file differs from the manifest: `mismatches` names it; its bytes items stay unparsed
        for req, data in deferred:
            self._load(req, data, planner)

    def _load(self, req, data: bytes, planner: LoadPlanner) -> None:
        """One read item from its bytes: what FileSystemReader does with a file slice."""
        info = self.storage_data[req.storage_index]
        stream = self.transforms.transform_load_stream(req, info.transform_descriptors or (), io.BytesIO(data))
        if req.type == LoadItemType.BYTE_IO:
            try:
                planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            except Rejected as exc:  # DCP wraps what its reader raises: keep the verdict
                raise self.reject(str(exc)) from None
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


def _read_exactly(fh, length: int) -> bytes:
    """`length` bytes from the current position, as `bytes`: io.BytesIO shares a bytes object's
    buffer instead of copying it (it copies a bytearray), so the record is copied once, by
    torch.load into its tensor, after the read."""
    data = fh.read(length)
    if len(data) == length:
        return data
    pieces = [data]
    got = len(data)
    while got < length:
        more = fh.read(length - got)
        if not more:
            raise OSError(f"{fh.name}: ends at {fh.tell()} bytes, a record needs {length - got} more")
        pieces.append(more)
        got += len(more)
    return b"".join(pieces)


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
