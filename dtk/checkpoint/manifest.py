"""The commit protocol of a checkpoint: `manifest.json`, written last and atomically.

A checkpoint folder counts only once its manifest exists, and it is trusted only while
every file the manifest lists still has the recorded size and checksum:

    {
      "format": 1,
      "step": 50, "samples_consumed": 1600, "global_batch": 32,
      "world_size": 4, "mesh": {"dp_replicate": 4, "dp_shard": 1, "tp": 1, "pp": 1}, "scheme": "ddp",
      "config_hash": "...", "data_version": "...",
      "rng_files": ["rng_00000.pt", ...],          one per rank, restored when the world size is unchanged
      "files": {"__0_0.distcp": {"size": 123, "crc32": "9a0b1c2d"}, ..., ".metadata": ..., "trainer.json": ...},
      "save_seconds": 0.41, "time": 1700000000.0
    }

The checksum is CRC-32 (zlib, in 8 MiB chunks): it runs at several GB/s on one core,
releases the GIL, and catches truncation and flipped bytes, which is what it is for
(a checksum against disks and killed writers, not against an attacker).

A folder is a `Path` or a `dtk.common.storage.Storage` (local files, or an object store
such as S3): the commit and every check read and write through it, the same on both.

No torch here: `python -m dtk.checkpoint list` runs on a login node.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtk.checkpoint.trust import CHECKSUM, Rejected, check_metadata, storage_of
from dtk.common.rundir import MANIFEST, RunDir, write_json_atomic
from dtk.common.storage import LocalStorage, Storage, checkpoint_steps, checkpoints_of, local_path

FORMAT_VERSION = 1
CHUNK = 8 << 20


def file_checksum(path: Path) -> str:
    return _checksum(open(path, "rb", buffering=0))


def stored_checksum(store: Storage, name: str) -> str:
    if isinstance(store, LocalStorage):
        return file_checksum(store.path / name)
    return _checksum(store.open_read(name))


def _checksum(stream: Any) -> str:
    crc = 0
    with stream as fh:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def describe_file(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, CHECKSUM: file_checksum(path)}


def describe(folder: Path | Storage, name: str) -> dict[str, Any]:
    """The manifest's entry of file `name`, read back from the storage."""
    if isinstance(folder, LocalStorage):
        folder = folder.path
    if isinstance(folder, Path):
        return describe_file(folder / name)
    store = folder
    return {"size": store.size(name), CHECKSUM: stored_checksum(store, name)}


def write_json(folder: Path | Storage, name: str, obj: Any) -> None:
    """A JSON file of a checkpoint folder, written atomically (rundir.write_json_atomic on
    local disk; one PUT in an object store)."""
    if isinstance(folder, LocalStorage):
        folder = folder.path
    if isinstance(folder, Path):
        write_json_atomic(folder / name, obj)
    else:
        folder.write_bytes(name, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def payload_files(folder: Path | Storage) -> list[str]:
    """Every file of a checkpoint folder that the manifest must cover (all but itself and temp files)."""
    return [name for name in storage_of(folder).files()
            if name != MANIFEST and not name.startswith(f".{MANIFEST}.tmp")]


def commit(folder: Path | Storage, manifest: dict[str, Any]) -> None:
    """Write the manifest (temp file, fsync, rename) and make the rename itself durable. In an
    object store, one PUT of the manifest after every other object: the same commit point
    (a PUT is atomic; there is no rename)."""
    if isinstance(folder, LocalStorage):
        folder = folder.path
    write_json(folder, MANIFEST, manifest)
    if not isinstance(folder, Path):
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(folder: Path | Storage) -> dict[str, Any]:
    store = storage_of(folder)
    try:
        manifest = json.loads(store.read_bytes(MANIFEST).decode())
    except FileNotFoundError:
        raise Rejected("no manifest.json: the save did not finish, or the manifest was deleted") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Rejected(f"manifest.json unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise Rejected(f"manifest.json has format {manifest.get('format') if isinstance(manifest, dict) else '?'}, expected {FORMAT_VERSION}")
    for key in ("step", "files", "world_size", "samples_consumed"):
        if key not in manifest:
            raise Rejected(f"manifest.json lacks '{key}'")
    if not isinstance(manifest["files"], dict) or not manifest["files"]:
        raise Rejected("manifest.json lists no files")
    m = store.name.removeprefix("step_")
    if m.isdigit() and int(m) != manifest["step"]:
        raise Rejected(f"manifest.json says step {manifest['step']} in folder {store.name}")
    return manifest


def check_sizes(folder: Path | Storage, manifest: dict[str, Any]) -> list[str]:
    """Problems found by looking at sizes only (cheap: no file is read)."""
    store = storage_of(folder)
    problems = []
    for name, want in manifest["files"].items():
        try:
            size = store.size(name)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != want["size"]:
            problems.append(f"{name} has {size} bytes, manifest says {want['size']}")
    return problems


def check_checksums(folder: Path | Storage, manifest: dict[str, Any], names: list[str]) -> list[str]:
    store = storage_of(folder)
    problems = []
    for name in names:
        want = manifest["files"][name]
        try:
            got = stored_checksum(store, name)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if got != want.get(CHECKSUM):
            problems.append(f"{name} {CHECKSUM} {got}, manifest says {want.get(CHECKSUM)}")
    return problems


def verify(folder: Path | Storage, *, checksums: bool = True) -> dict[str, Any]:
    """The manifest of a checkpoint whose files all match it and whose `.metadata` is DCP's
    metadata only (dtk.checkpoint.trust, without torch); raises Rejected otherwise. One
    process reads every file; workers share the reading (see dtk.checkpoint.load).
    `checksums=False`: the manifest and the sizes only, nothing read or parsed."""
    manifest = read_manifest(folder)
    problems = check_sizes(folder, manifest)
    if not problems and checksums:
        problems = check_checksums(folder, manifest, sorted(manifest["files"]))
    if problems:
        raise Rejected(summarize(problems))
    if checksums:
        check_metadata(folder, manifest)
    return manifest


def summarize(problems: list[str], limit: int = 3) -> str:
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


@dataclass(frozen=True)
class Listing:
    step: int
    path: Any  # the folder: a Path in a run directory, a Storage in a checkpoint store
    size: int
    committed: bool
    verified: bool
    reason: str
    manifest: dict[str, Any] | None


def folder_size(folder: Path | Storage) -> int:
    store = storage_of(folder)
    return sum(store.size(name) for name in store.files())


def list_checkpoints(run: RunDir | Storage, *, checksums: bool = True) -> list[Listing]:
    """Every checkpoint folder of a run (where its checkpoint.dir puts them: `checkpoints_of`)
    or of a checkpoint store, oldest first, each verified. A local folder is listed as its Path."""
    out = []
    store = checkpoints_of(run) if isinstance(run, RunDir) else run
    for step, folder, committed in checkpoint_steps(store):
        path = local_path(folder)
        manifest = None
        try:
            manifest = verify(path, checksums=checksums)
            ok, reason = True, ""
        except Rejected as exc:
            ok, reason = False, str(exc)
        out.append(Listing(step, path, folder_size(path), committed, ok, reason, manifest))
    return out

