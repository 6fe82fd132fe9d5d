"""Where a checkpoint's bytes live: one interface for every read, write, list and delete.

A `Storage` is a folder: a checkpoint folder (`step_00000050/`) or the folder that holds
them. Two backends:

- `LocalStorage`: a POSIX folder. `write_bytes` writes a temp file, fsyncs it and renames
  it over the name, then fsyncs the folder, so a reader sees the old file or the new one.
- `FsspecStorage`: an object store through fsspec (`s3://BUCKET/PREFIX` with s3fs). An
  object store has no rename and no folders; one PUT of an object is atomic, so
  `write_bytes` is a single PUT and a "folder" is the objects under its prefix.

The commit protocol is the same on both (dtk.checkpoint.manifest): the shards first, then
`manifest.json`, written last with `write_bytes`; a folder without it never counts. The
trust rules do not change either: the manifest's sizes and CRCs are checked through
`size` and `open_read` before anything parses a file (dtk.checkpoint.trust).

Every lookup of a run's checkpoints goes through a store, wherever checkpoint.dir puts them:
`checkpoints_of(run)` (the location its plan.json records) with `checkpoint_steps`,
`committed_steps` and `latest_committed_step` (a folder counts once its manifest exists),
and `Storage.retire` to take a checkpoint away. The Slurm driver on the batch host decides a
requeue by the newest committed step it reads this way, the launch's resume check and a
rollback's choice read it too, so a run whose checkpoints live in an object store recovers
as one in RUN_DIR/checkpoints/ does.

No torch here, and fsspec/s3fs are imported only for a URL (`open_storage`): the login
node's `python -m dtk.checkpoint list` of a local run and the driver of a local run import
neither.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from dtk.common.errors import UserError
from dtk.common.rundir import CHECKPOINT_DIR_RE, MANIFEST, RunDir

SCHEMES = ("s3",)
"""URL schemes a checkpoint location may have besides a local path."""

BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")  # S3's bucket naming rules


class StoreUnreachable(OSError):
    """An object store that did not answer a listing (its endpoint down, credentials refused):
    an OSError, as a local folder's failures are, whatever the client library raised."""


class Storage(ABC):
    """A folder of a checkpoint store. Names are relative to it, one component each."""

    url: str  # where it is, for messages and events

    @property
    @abstractmethod
    def name(self) -> str:
        """The folder's own name (`step_00000050`)."""

    @abstractmethod
    def child(self, name: str) -> Storage:
        """The folder `name` inside this one (it need not exist)."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether the file `name` exists in this folder."""

    @abstractmethod
    def size(self, name: str) -> int:
        """The size of file `name` in bytes; FileNotFoundError without it."""

    @abstractmethod
    def open_read(self, name: str) -> IO[bytes]:
        """File `name` opened for reading bytes; FileNotFoundError without it."""

    @abstractmethod
    def write_bytes(self, name: str, data: bytes) -> None:
        """Write file `name` so that readers see the old content or `data`, never part of it."""

    @abstractmethod
    def files(self) -> list[str]:
        """The names of the files in this folder (not in folders below it), sorted."""

    @abstractmethod
    def folders(self) -> list[str]:
        """The names of the folders in this folder, sorted."""

    @abstractmethod
    def create(self) -> None:
        """Make the folder exist (an object store has no folders: nothing to do)."""

    @abstractmethod
    def delete(self) -> None:
        """Delete this folder and everything in it (nothing happens when it does not exist)."""

    @abstractmethod
    def retire(self, tag: str, *, ignore_errors: bool = False) -> None:
        """Delete this checkpoint folder so that no listing sees part of it as a checkpoint
        (`tag` names why, in a local folder's temporary name). `ignore_errors`: what is left
        once it no longer counts may stay behind."""

    def __str__(self) -> str:
        return self.url

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """The bytes of file `name` (at most `limit`)."""
        with self.open_read(name) as fh:
            return fh.read() if limit is None else fh.read(limit)


class LocalStorage(Storage):
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.url = str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(self.path / name)

    def exists(self, name: str) -> bool:
        return (self.path / name).is_file()

    def size(self, name: str) -> int:
        return (self.path / name).stat().st_size

    def open_read(self, name: str) -> IO[bytes]:
        return open(self.path / name, "rb", buffering=0)

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        with open(self.path / name, "rb") as fh:  # buffered: read(n) returns n bytes unless at the end
            return fh.read() if limit is None else fh.read(limit)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{name}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path / name)
        fd = os.open(self.path, os.O_RDONLY)  # the rename itself durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def files(self) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if p.is_file())

    def folders(self) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if p.is_dir())

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def delete(self) -> None:
        if self.path.exists():
            shutil.rmtree(self.path)

    def retire(self, tag: str, *, ignore_errors: bool = False) -> None:
        # Out of the step_NNNNNNNN pattern first, in one rename: no listing sees half a folder.
        doomed = self.path.with_name(f".{tag}-{self.path.name}-{os.getpid()}")
        os.replace(self.path, doomed)
        shutil.rmtree(doomed, ignore_errors=ignore_errors)


class FsspecStorage(Storage):
    """A prefix of an fsspec file system (`fs`), `root` without the scheme (`bucket/prefix`)."""

    def __init__(self, fs: Any, root: str, *, scheme: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.scheme = scheme
        self.url = f"{scheme}://{self.root}"

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    @property
    def name(self) -> str:
        return self.root.rsplit("/", 1)[-1]

    def child(self, name: str) -> FsspecStorage:
        return FsspecStorage(self.fs, self._key(name), scheme=self.scheme)

    def exists(self, name: str) -> bool:
        return bool(self.fs.isfile(self._key(name)))

    def size(self, name: str) -> int:
        return int(self.fs.info(self._key(name))["size"])  # FileNotFoundError without it

    def open_read(self, name: str) -> IO[bytes]:
        return self.fs.open(self._key(name), "rb")

    def write_bytes(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self._key(name), data)  # one PUT: the object is all there or absent

    def _entries(self) -> list[dict[str, Any]]:
        try:
            return list(self.fs.ls(self.root, detail=True, refresh=True))
        except FileNotFoundError:
            return []
        except OSError:
            raise
        except Exception as exc:  # botocore's errors (no endpoint, no credentials) are no OSError
            raise StoreUnreachable(f"cannot list {self.url}: {exc}") from exc

    def files(self) -> list[str]:
        return sorted(e["name"].rsplit("/", 1)[-1] for e in self._entries() if e["type"] == "file")

    def folders(self) -> list[str]:
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self._entries() if e["type"] == "directory")

    def create(self) -> None:
        pass

    def delete(self) -> None:
        # The manifest first: a delete cut short leaves an uncommitted folder, which nothing
        # loads and retention removes, never a committed one with files missing.
        keys = self.fs.find(self.root)
        manifest = self._key(MANIFEST)
        if manifest in keys:
            self.fs.rm_file(manifest)
        rest = [k for k in keys if k != manifest]
        if rest:
            self.fs.rm(rest)
        self.fs.invalidate_cache(self.root)

    def retire(self, tag: str, *, ignore_errors: bool = False) -> None:
        # No rename in an object store: the commit (the manifest) goes first, in one DELETE,
        # then the rest (`delete`); a listing in between sees an uncommitted folder.
        try:
            self.delete()
        except OSError:
            if not ignore_errors or self.exists(MANIFEST):
                raise


def _parse(location: str, key: str) -> tuple[str, str, str]:
    """(scheme, bucket, prefix) of a URL; a UserError naming `key` for a malformed one, another
    scheme, or s3fs not installed (found without importing it)."""
    parts = urlsplit(location)
    if parts.scheme not in SCHEMES:
        raise UserError(f"{key}={location}: unknown scheme {parts.scheme!r}; use a local path or"
                        f" {' or '.join(s + '://BUCKET/PREFIX' for s in SCHEMES)}")
    if not BUCKET_RE.match(parts.netloc) or parts.query or parts.fragment:
        raise UserError(f"{key}={location}: not a valid S3 URL; write s3://BUCKET/PREFIX with a bucket"
                        " name of 3-63 lower-case letters, digits, dots and hyphens")
    prefix = parts.path.strip("/")
    if "//" in prefix or any(part in (".", "..") for part in prefix.split("/")):
        raise UserError(f"{key}={location}: the prefix {parts.path!r} has an empty, '.' or '..' part")
    if importlib.util.find_spec("s3fs") is None:
        raise UserError(f"{key}={location}: an s3:// location needs s3fs, which is not installed;"
                        ' pip install "dtk-train[s3]"')
    return parts.scheme, parts.netloc, prefix


def check_location(location: str, *, async_save: bool, async_mode: str) -> None:
    """checkpoint.dir checked at submission (no connection made, s3fs not imported): a
    UserError for what the workers' `run_storage` would refuse. A Slurm job may use an object
    store as the local cluster does: its driver reads the committed steps there
    (`checkpoints_of`), and the job inherits the submitting shell's AWS_* variables."""
    if not location:
        return
    if "://" not in location:
        run_storage(RunDir(Path()), location)  # the refusal of a local folder, worded once
    _parse(location, "checkpoint.dir")
    if async_save and async_mode == "process":
        raise UserError(f"checkpoint.async_mode=process writes local files only, not checkpoint.dir={location};"
                        " use checkpoint.async_mode=thread (the default) with an object store")


def open_storage(location: str | Path, *, key: str = "checkpoint.dir") -> Storage:
    """The storage of a local path or a URL (`s3://BUCKET/PREFIX`); a UserError naming `key`
    for a malformed URL, another scheme, or s3fs not installed."""
    if isinstance(location, Path) or "://" not in location:
        return LocalStorage(Path(location))
    scheme, bucket, prefix = _parse(location, key)
    import s3fs
    # No instance or listing cache: several processes write the store, and a listing must
    # see the manifest another rank wrote a moment ago.
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                           **_endpoint_kwargs())
    return FsspecStorage(fs, f"{bucket}/{prefix}" if prefix else bucket, scheme=scheme)


def run_storage(run: RunDir, location: str) -> Storage:
    """A run's checkpoint store (`checkpoint.dir`): empty, the run directory's checkpoints/
    folder; a URL, PREFIX/RUN_DIR_NAME/ there (so runs that share a prefix never share a
    folder). A UserError for anything else."""
    if not location:
        return LocalStorage(run.checkpoints)
    if "://" not in location:
        raise UserError(f"checkpoint.dir={location}: a local folder other than the run directory's is not"
                        " supported; leave checkpoint.dir empty (RUN_DIR/checkpoints) or give s3://BUCKET/PREFIX")
    return open_storage(location).child(run.path.name)


def checkpoints_of(run: RunDir) -> Storage:
    """The checkpoint store of an existing run, for the commands that read it (list, export):
    the checkpoint.dir its plan.json records (none recorded, as in a run of a dtk before the
    key or a folder without a plan: its checkpoints/ folder)."""
    location = ""
    try:
        section = json.loads(run.plan_json.read_text())["config"]["checkpoint"]
        if isinstance(section, dict) and isinstance(section.get("dir"), str):  # plan.json, not a config
            location = section["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return run_storage(run, location)


def _endpoint_kwargs() -> dict[str, Any]:
    """An S3-compatible server's endpoint from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (as the
    AWS tools read them); credentials come from the usual AWS variables and files."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}


def checkpoint_steps(store: Storage) -> list[tuple[int, Storage, bool]]:
    """(step, folder, committed) for every checkpoint folder of a store, oldest first
    (committed: its manifest exists). The listing every lookup of dtk's goes through."""
    found = []
    for name in store.folders():
        m = CHECKPOINT_DIR_RE.match(name)
        if m:
            folder = store.child(name)
            found.append((int(m.group(1)), folder, folder.exists(MANIFEST)))
    return sorted(found, key=lambda item: item[0])


def checkpoint_folder(store: Storage, step: int) -> Storage:
    """The folder of step `step`'s checkpoint, named as RunDir.checkpoint_dir names it."""
    return store.child(RunDir(Path()).checkpoint_dir(step).name)


def committed_steps(store: Storage) -> list[int]:
    """Steps whose checkpoint folder holds its manifest (committed), oldest first."""
    return [step for step, _, committed in checkpoint_steps(store) if committed]


def latest_committed_step(store: Storage) -> int | None:
    """The newest committed checkpoint (what a resume tries first); None without one."""
    committed = committed_steps(store)
    return committed[-1] if committed else None


def local_path(folder: Storage) -> Path | Storage:
    """A local folder as its Path (the readers of local files take one), any other as it is."""
    return folder.path if isinstance(folder, LocalStorage) else folder
