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

No torch here: `python -m dtk.checkpoint list` runs on a login node.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtk.checkpoint.trust import CHECKSUM, Rejected, check_metadata
from dtk.rundir import MANIFEST, RunDir, write_json_atomic

FORMAT_VERSION = 1
CHUNK = 8 << 20


def file_checksum(path: Path) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def describe_file(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, CHECKSUM: file_checksum(path)}


def payload_files(folder: Path) -> list[str]:
    """Every file of a checkpoint folder that the manifest must cover (all but itself and temp files)."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(f".{MANIFEST}.tmp")
    )


def commit(folder: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest (temp file, fsync, rename) and make the rename itself durable."""
    write_json_atomic(folder / MANIFEST, manifest)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
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
    m = folder.name.removeprefix("step_")
    if m.isdigit() and int(m) != manifest["step"]:
        raise Rejected(f"manifest.json says step {manifest['step']} in folder {folder.name}")
    return manifest


def check_sizes(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems found by looking at sizes only (cheap: no file is read)."""
    problems = []
    for name, want in manifest["files"].items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != want["size"]:
            problems.append(f"{name} has {size} bytes, manifest says {want['size']}")
    return problems


def check_checksums(folder: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    problems = []
    for name in names:
        want = manifest["files"][name]
        try:
            got = file_checksum(folder / name)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if got != want.get(CHECKSUM):
            problems.append(f"{name} {CHECKSUM} {got}, manifest says {want.get(CHECKSUM)}")
    return problems


def verify(folder: Path, *, checksums: bool = True) -> dict[str, Any]:
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
    path: Path
    size: int
    committed: bool
    verified: bool
    reason: str
    manifest: dict[str, Any] | None


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def list_checkpoints(run: RunDir, *, checksums: bool = True) -> list[Listing]:
    """Every checkpoint folder of a run, oldest first, each verified."""
    out = []
    for step, path, committed in run.checkpoint_steps():
        manifest = None
        try:
            manifest = verify(path, checksums=checksums)
            ok, reason = True, ""
        except Rejected as exc:
            ok, reason = False, str(exc)
        out.append(Listing(step, path, folder_size(path), committed, ok, reason, manifest))
    return out

