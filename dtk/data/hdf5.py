"""A token dataset on disk: one folder of HDF5 shards and a manifest.

    DIR/
        manifest.json       format, version, seq_len, dtype, vocab_size, tokenizer, and per
                            shard: file, num_samples, size, crc32 - written last
        shard_00000.h5      dataset `tokens`: (num_samples, seq_len + 1), unsigned ints
        shard_00001.h5 ...

A sample is one row of `seq_len + 1` tokens (inputs are [:-1], targets [1:]), numbered
across shards in manifest order. The version is a hash of the content (layout and every
token), not of the files, so the same tokens always give the same version; a run records
it and refuses to resume on another. `python -m dtk.data prepare` makes such a folder.

Reading: each shard's `tokens` is stored contiguous and uncompressed, so a worker maps
it into memory (h5py finds the offset) and gathers rows with numpy - no HDF5 call, and no
lock, on the training path. No torch here: the CLI runs on a login node.
"""

from __future__ import annotations

import json
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from dtk.common.errors import UserError
from dtk.config.choices import DataKind
from dtk.config.schema import ModelConfig
from dtk.plan.plan import check_eval_split

MANIFEST = "manifest.json"
FORMAT = 1
TOKENS = "tokens"


def file_checksum(path: Path, chunk: int = 8 << 20) -> str:
    """CRC-32 of a file as 8 hex digits (the same checksum checkpoint manifests use)."""
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def read_manifest(path: Path, *, key: str = "data.path") -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        what = "no such folder" if not path.exists() else f"no {MANIFEST} in it"
        raise UserError(
            f"{key}={path}: {what}; make a dataset with python -m dtk.data prepare --input PATH --out DIR"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{key}={path}: {MANIFEST} is unreadable ({exc}); prepare the dataset again") from None
    if manifest.get("format") != FORMAT:
        raise UserError(f"{key}={path}: dataset format {manifest.get('format')}, this dtk reads format {FORMAT}")
    return manifest


def check_shards(path: Path, manifest: dict[str, Any], *, checksums: bool, key: str = "data.path") -> None:
    """Raise UserError naming the first shard that is missing, has another size, or (with
    `checksums`) another checksum than the manifest says."""
    for shard in manifest["shards"]:
        file = path / shard["file"]
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise UserError(f"{key}={path}: shard {shard['file']} is missing; prepare the dataset again") from None
        if size != shard["size"]:
            raise UserError(
                f"{key}={path}: shard {shard['file']} has {size} bytes, the manifest says {shard['size']};"
                " prepare the dataset again"
            )
        if checksums and file_checksum(file) != shard["crc32"]:
            raise UserError(
                f"{key}={path}: shard {shard['file']} does not match its crc32 in the manifest; prepare the dataset again"
            )


class Hdf5Tokens:
    """The samples of a dataset folder; `get(ids)` is safe to call from a loader thread."""

    def __init__(self, path: str | Path, *, verify: bool = False) -> None:
        self.path = Path(path).expanduser()
        self.manifest = read_manifest(self.path)
        check_shards(self.path, self.manifest, checksums=verify)
        self.version: str = self.manifest["version"]
        self.seq_len: int = self.manifest["seq_len"]
        self.vocab_size: int = self.manifest["vocab_size"]
        self.shard_names = [s["file"] for s in self.manifest["shards"]]
        # The validation shards `prepare --val-fraction` wrote: the split when the config names none.
        self.prepared_validation: list[str] = list(self.manifest["val_shards"]) if "val_shards" in self.manifest else []
        counts = np.array([s["num_samples"] for s in self.manifest["shards"]], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self._arrays: list[Any] = [None] * len(counts)
        self._files: list[Any] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard_range(self, name: str) -> range:
        i = self.shard_names.index(name)
        return range(int(self.starts[i]), int(self.starts[i + 1]))

    def _array(self, i: int) -> Any:
        arr = self._arrays[i]
        if arr is None:
            with self._lock:
                if self._arrays[i] is None:
                    self._arrays[i] = self._open(i)
                arr = self._arrays[i]
        return arr

    def _open(self, i: int) -> Any:
        import h5py

        file = self.path / self.shard_names[i]
        f = h5py.File(file, "r")
        ds = f[TOKENS]
        want = (self.manifest["shards"][i]["num_samples"], self.seq_len + 1)
        if ds.shape != want:
            raise UserError(f"data.path={self.path}: shard {file.name} holds {ds.shape}, the manifest says {want}")
        offset = ds.id.get_offset()
        if offset is not None and ds.chunks is None and ds.compression is None:
            arr = np.memmap(file, dtype=ds.dtype, mode="r", offset=offset, shape=ds.shape)
            f.close()
            return arr
        self._files.append(f)  # chunked or compressed (written by another tool): read through h5py
        return ds

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Rows of `seq_len + 1` tokens as int64, in the order of `ids`."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids outside [0, {len(self)})")
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        for s in np.unique(shard):
            where = np.nonzero(shard == s)[0]
            local = ids[where] - self.starts[s]
            arr = self._array(int(s))
            if isinstance(arr, np.ndarray):
                out[where] = arr[local]
            else:  # h5py wants increasing, unique indices
                uniq, inverse = np.unique(local, return_inverse=True)
                with self._lock:
                    out[where] = arr[uniq][inverse]
        return out


class Subset:
    """Some samples of a dataset, renumbered 0..n-1 (a split)."""

    def __init__(self, base: Any, indices: np.ndarray) -> None:
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.version = base.version

    def __len__(self) -> int:
        return len(self.indices)

    def get(self, ids: np.ndarray) -> np.ndarray:
        return self.base.get(self.indices[np.asarray(ids, dtype=np.int64)])


def split(dataset: Hdf5Tokens, *, val_fraction: float, seed: int, val_shards: list[str]) -> tuple[Subset, Subset]:
    """(train, validation), fixed by the config: the samples of `val_shards`, else of the
    validation shards `prepare --val-fraction` wrote (the manifest's `val_shards`), else a
    seeded `val_fraction` of all samples. The same on every rank and every restart."""
    n = len(dataset)
    val_shards = list(val_shards) or dataset.prepared_validation
    if val_shards:
        unknown = [s for s in val_shards if s not in dataset.shard_names]
        if unknown:
            raise UserError(
                f"data.val_shards={list(val_shards)}: no shard {unknown[0]} in {dataset.path}"
                f" (shards: {', '.join(dataset.shard_names)})"
            )
        is_val = np.zeros(n, dtype=bool)
        for name in val_shards:
            r = dataset.shard_range(name)
            is_val[r.start : r.stop] = True
        val, train = np.nonzero(is_val)[0], np.nonzero(~is_val)[0]
    else:
        if not 0 <= val_fraction < 1:
            raise UserError(f"data.val_fraction={val_fraction}: expected a fraction in [0, 1)")
        perm = np.random.default_rng([seed, 0x5EED]).permutation(n)
        num_val = int(round(n * val_fraction))
        val, train = np.sort(perm[:num_val]), np.sort(perm[num_val:])
    if len(train) == 0:
        raise UserError(f"data.path={dataset.path}: the validation split takes all {n} samples; nothing left to train on")
    return Subset(dataset, train), Subset(dataset, val)


def check_model(dataset: Hdf5Tokens, model: ModelConfig) -> None:
    """The model's input shape (when its factory takes one) against the dataset's."""
    seq_len, vocab = model.seq_len, model.vocab_size
    if seq_len is not None and seq_len != dataset.seq_len:
        raise UserError(
            f"model.seq_len={seq_len}, but the samples of data.path={dataset.path} hold {dataset.seq_len} tokens"
            f" (+1 target); set model.seq_len={dataset.seq_len} or prepare with --seq-len {seq_len}"
        )
    if vocab is not None and vocab < dataset.vocab_size:
        raise UserError(
            f"model.vocab_size={vocab} is smaller than the vocabulary of data.path={dataset.path}"
            f" ({dataset.vocab_size} token ids); set model.vocab_size={dataset.vocab_size} or more"
        )


def check_config(data: Any, model: ModelConfig, *, eval_every: int = 0, global_batch: int = 1) -> None:
    """What the submitting machine can check before a job is queued (reads the manifest):
    the dataset fits the model, and its validation split holds one global batch when
    train.eval_every asks for evaluations (a user's dataset: its workers check that)."""
    if data.kind == DataKind.synthetic:
        from dtk.data.synthetic import VALIDATION_SAMPLES

        check_eval_split(VALIDATION_SAMPLES, every=eval_every, max_samples=data.eval_samples, global_batch=global_batch)
    if data.kind != DataKind.hdf5:
        return
    dataset = Hdf5Tokens(data.path)
    check_model(dataset, model)
    _, val = split(dataset, val_fraction=data.val_fraction, seed=data.split_seed, val_shards=data.val_shards)
    check_eval_split(len(val), every=eval_every, max_samples=data.eval_samples, global_batch=global_batch)
