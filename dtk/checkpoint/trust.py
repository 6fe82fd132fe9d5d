"""What a checkpoint may make a reader do: parse data, never run code. No torch at import.

The manifest's CRCs catch disks and killed writers, not people: whoever can write the
checkpoint folder can rewrite the manifest too (under `access=team` the maintainers write
checkpoints and viewers export them). So safety does not come from the checksums; it
comes from never unpickling an arbitrary object:

- `.metadata` (DCP's index, a pickle) is read whole into memory, checked against the
  manifest (size and CRC), and only then unpickled by `MetadataUnpickler`, which admits
  the few classes DCP's metadata is made of (`ALLOWED`, found in checkpoints of every
  scheme) and refuses any other reference with a rejection. Its index may point only at
  files the manifest lists, by plain name.
- BYTE_IO items (values DCP stores pickled inside a shard) are loaded only under the keys
  dtk itself writes as bytes (`BYTES_PREFIXES`: the optimizer's param groups), with
  torch.load(weights_only=True), and must come out as plain values (dtk.checkpoint.safe).
- Tensors load with weights_only=True (dtk.checkpoint.reading); trainer.json is JSON; the
  RNG files hold plain tensors, loaded with weights_only=True after their CRC is checked.
"""

from __future__ import annotations

import io
import os
import pickle
import zlib
from pathlib import Path
from typing import Any

from dtk.common.storage import LocalStorage, Storage

CHECKSUM = "crc32"
METADATA = ".metadata"


class Rejected(Exception):
    """A checkpoint that must not be loaded; the message says why, in a few words."""


DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (DCP_METADATA, "Metadata"),
    (DCP_METADATA, "MetadataIndex"),
    (DCP_METADATA, "StorageMeta"),
    (DCP_METADATA, "TensorStorageMetadata"),
    (DCP_METADATA, "BytesStorageMetadata"),
    (DCP_METADATA, "ChunkStorageMetadata"),
    (DCP_METADATA, "TensorProperties"),
    (DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the folder it was saved to
})
"""(module, name) of every global a `.metadata` that dtk writes refers to, read from
checkpoints of every scheme (ddp, zero, fsdp, hsdp, tp, pp, hybrid; sync and async saves).
Each is a plain container whose construction runs no code of the pickle's choosing."""

ENUMS: dict[tuple[str, str], frozenset[str]] = {
    (DCP_METADATA, "_MEM_FORMAT_ENCODING"): frozenset({"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST",
                                                       "TORCH_PRESERVE_FORMAT"}),
}
"""The admitted classes that are Enums, with their members. Some Pythons (3.11.0-3.11.3,
3.12+) pickle an Enum member as `getattr(EnumClass, "NAME")`: `builtins.getattr` is admitted
only in that form, on one of these classes and one of its members, so it reaches nothing else
(checked against the names here without torch, and against the class's own members with it)."""

DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
})
"""torch dtypes a tensor's properties may name (`torch.float32` pickles as a global)."""

BYTES_PREFIXES = ("optim.param_groups.",)
"""The keys dtk stores as DCP bytes items: the optimizer's param-group settings (lr, betas,
eps, weight_decay, flags), which DCP pickles because they are not tensors. Everything
else dtk saves is a tensor in a shard, JSON (trainer.json) or plain tensors (rng_*.pt)."""

MAX_SMALL = 256 << 20  # a `.metadata` larger than this is not one dtk wrote


class _Standin:
    """What an admitted global becomes when the caller has no torch (a login node's
    `checkpoint list`): it takes any arguments and state, so the pickle parses to the end
    and its references are all checked, and nothing of torch's is imported or run."""

    args: tuple[Any, ...]

    def __new__(cls, *args: Any, **kwargs: Any) -> _Standin:
        obj = super().__new__(cls)
        obj.args = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else. `resolve=False`: stand-ins instead of
    torch's classes, so a check needs no torch."""

    def __init__(self, file: io.BufferedIOBase, *, resolve: bool) -> None:
        super().__init__(file)
        self.resolve = resolve
        self._standins: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return self._enum_member
        dtype = module == "torch" and name in DTYPES
        if (module, name) not in ALLOWED and not dtype:
            raise Rejected(f"{METADATA} refers to {module}.{name}, which is not one of DCP's metadata classes;"
                           " a checkpoint holds data, never code, so it is refused unread")
        if not self.resolve:
            key = (module, name)
            if key not in self._standins:
                self._standins[key] = type(name, (_Standin,), {})
            return self._standins[key]
        value = super().find_class(module, name)
        if dtype:
            import torch

            assert isinstance(value, torch.dtype), (module, name)
        return value

    def _enum_member(self, *args: Any) -> Any:
        """`getattr(cls, name)` as a pickled Enum member, and nothing else."""
        import enum

        cls: Any = args[0] if len(args) == 2 else None
        name: Any = args[1] if len(args) == 2 else None
        key = next((k for k, standin in self._standins.items() if standin is cls), None)
        if key is None and isinstance(cls, type) and issubclass(cls, enum.Enum):
            key = (cls.__module__, cls.__qualname__)
            if name not in cls.__members__:
                key = None
        if key is None or name not in ENUMS.get(key, ()):
            raise Rejected(f"{METADATA} calls getattr on {cls!r}, not on a member of DCP's metadata Enums;"
                           " a checkpoint holds data, never code, so it is refused unread")
        return cls(name) if not self.resolve else cls[name]

    def persistent_load(self, pid: Any) -> Any:
        raise Rejected(f"{METADATA} holds a persistent reference, which DCP's metadata never does")


def storage_of(folder: Path | Storage) -> Storage:
    """A checkpoint folder as a Storage (a Path is a local folder)."""
    return folder if isinstance(folder, Storage) else LocalStorage(folder)


def read_checked(folder: Path | Storage, name: str, manifest: dict[str, Any], *, limit: int = MAX_SMALL) -> bytes:
    """The bytes of a small file of the checkpoint, after their size and CRC matched the
    manifest: nothing parses them before. Rejected otherwise."""
    want = manifest["files"].get(name)
    if want is None:
        raise Rejected(f"{name} is not listed in manifest.json")
    if not isinstance(want.get("size"), int) or want["size"] > limit:
        raise Rejected(f"{name}: manifest says {want.get('size')} bytes, more than a {name} of dtk's ({limit})")
    try:
        data = storage_of(folder).read_bytes(name, want["size"] + 1)
    except FileNotFoundError:
        raise Rejected(f"{name} is missing") from None
    if len(data) != want["size"]:
        raise Rejected(f"{name} has {len(data)} bytes, manifest says {want['size']}")
    crc = f"{zlib.crc32(data):08x}"
    if crc != want.get(CHECKSUM):
        raise Rejected(f"{name} {CHECKSUM} {crc}, manifest says {want.get(CHECKSUM)}")
    return data


def parse_metadata(data: bytes, manifest: dict[str, Any], *, resolve: bool) -> Any:
    """DCP's Metadata from the checked bytes of `.metadata`; Rejected when it refers to
    anything else, or points at a file the manifest does not list."""
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), resolve=resolve).load()
    except Rejected:
        raise
    except Exception as exc:  # a truncated or malformed pickle: the manifest matched a bad file
        raise Rejected(f"{METADATA} is not DCP metadata ({type(exc).__name__}: {exc})") from None
    if type(metadata).__name__ != "Metadata" or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise Rejected(f"{METADATA} holds a {type(metadata).__name__}, not DCP's Metadata")
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise Rejected(f"{METADATA} has no index of the state dict")
    for info in metadata.storage_data.values():
        where = getattr(info, "relative_path", None)
        if type(info).__name__ != "_StorageInfo" or not isinstance(where, str):
            raise Rejected(f"{METADATA} indexes a {type(info).__name__}, not a file slice")
        if os.sep in where or where in ("", ".", "..") or where not in manifest["files"] or where == METADATA:
            raise Rejected(f"{METADATA} points at {where!r}, which is not a shard listed in manifest.json")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(offset) is int and type(length) is int and 0 <= offset
                and 0 <= length <= manifest["files"][where]["size"] - offset):
            raise Rejected(f"{METADATA} points at bytes {offset}+{length} of {where}, which has"
                           f" {manifest['files'][where]['size']}")
        if getattr(info, "transform_descriptors", None):  # DCP's stream extensions: dtk saves with none
            raise Rejected(f"{METADATA} asks for stream transforms {info.transform_descriptors!r}, which dtk never writes")
    return metadata


def check_metadata(folder: Path | Storage, manifest: dict[str, Any]) -> None:
    """Torch-free: Rejected unless `.metadata` matches the manifest and is DCP metadata only."""
    parse_metadata(read_checked(folder, METADATA, manifest), manifest, resolve=False)


def bytes_key_refusal(fqn: str) -> str | None:
    """Why a bytes item of this key is not loaded, or None for a key dtk writes as bytes."""
    if fqn.startswith(BYTES_PREFIXES):
        return None
    return (f"{METADATA} stores {fqn!r} as pickled bytes; dtk stores only the optimizer's param groups"
            f" so ({', '.join(BYTES_PREFIXES)}), so it is refused unread")
