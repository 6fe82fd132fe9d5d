"""DCP's reader and planner with nothing unpickled but data (the rules: dtk.checkpoint.trust).

torch's `FileSystemReader.read_metadata` is `pickle.load` of `.metadata`, and its
`DefaultLoadPlanner.load_bytes` is `torch.load(weights_only=False)` of each bytes item: a
planted file runs whatever it names. `SafeReader.read_metadata` reads `.metadata` after its
size and CRC matched the manifest, with an unpickler that admits DCP's metadata classes
only; `SafeLoadPlanner.load_bytes` loads only the keys dtk writes as bytes, with
weights_only=True, and only plain values. Every DCP load of dtk (resume, export) uses both.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from dtk.checkpoint.manifest import Rejected
from dtk.checkpoint.trust import METADATA, bytes_key_refusal, parse_metadata, read_checked
from dtk.common.storage import LocalStorage, Storage

PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return False


def load_bytes_item(fqn: str, data: io.BytesIO) -> Any:
    """The value of one DCP bytes item, if dtk writes that key as bytes and the value is plain
    (a number, a flag, a string, a tuple of them); Rejected otherwise."""
    refusal = bytes_key_refusal(fqn)
    if refusal:
        raise Rejected(refusal)
    try:
        value = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses any global outside torch's safe set
        text = " ".join(str(exc).split())
        found = re.search(r"GLOBAL (\S+)", text)
        why = f"it refers to {found.group(1).rstrip('.')}" if found else f"{type(exc).__name__}: {text[:200]}"
        raise Rejected(f"bytes item {fqn!r} does not load as plain data ({why})") from None
    if not _plain(value):
        raise Rejected(f"bytes item {fqn!r} holds a {type(value).__name__}, not a plain value")
    return value


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose bytes items load as plain data only (`load_bytes_item`)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_bytes_item(fqn, value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is checked against the manifest and unpickled as
    DCP metadata only. `rejection` keeps why a checkpoint was refused, since DCP wraps the
    exceptions of its reader in its own."""

    def __init__(self, path: str | os.PathLike | Storage, *, manifest: dict[str, Any]) -> None:
        # every read goes through the storage (local files or an object store)
        self.storage = path if isinstance(path, Storage) else LocalStorage(Path(path))
        super().__init__(self.storage.url)
        self.manifest = manifest
        self.rejection: str | None = None
        self._metadata: Metadata | None = None
        self.metadata_crc: str | None = None

    def reject(self, reason: str) -> Rejected:
        if self.rejection is None:
            self.rejection = reason
        return Rejected(reason)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # a per-rank .metadata: not what dtk writes
            raise self.reject(f"no single {METADATA}; dtk does not read per-rank metadata")
        if self._metadata is None:
            try:
                data = read_checked(self.storage, METADATA, self.manifest)
                metadata = parse_metadata(data, self.manifest, resolve=True)
            except Rejected as exc:
                raise self.reject(str(exc)) from None
            if not isinstance(metadata, Metadata):
                raise self.reject(f"{METADATA} holds a {type(metadata).__name__}, not DCP's Metadata")
            self.metadata_crc = self.manifest["files"][METADATA]["crc32"]
            self._metadata = metadata
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:  # what torch's read_metadata does after pickle.load
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        assert isinstance(planner, SafeLoadPlanner), "dtk loads checkpoints with SafeLoadPlanner only"
        return super().read_data(plan, planner)
