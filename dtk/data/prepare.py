"""Build a dataset folder (dtk.data.hdf5) from token arrays or plain text.

Input: one file or a folder of files (read in name order).
  - `.npy`: integer token ids. 1-D: one stream, cut into samples of seq_len + 1 tokens.
    2-D: one sample per row (rows must hold seq_len + 1 tokens).
  - anything else: plain text, tokenized by `--tokenizer` (dtk.data.tokenize): `bytes` (UTF-8
    bytes, ids 0..255, the default), `chars` (one id per distinct character), or a local
    Hugging Face tokenizer folder.
The tail that does not fill a whole sample is dropped. `--val-fraction F` writes the last F
of the samples as validation shards (`val_00000.h5` ...), which the manifest names
(`val_shards`) and a job uses as its validation split. The same input and options give
the same folder, byte for byte, and so the same version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from dtk.common.errors import UserError
from dtk.data.hdf5 import FORMAT, MANIFEST, TOKENS, file_checksum
from dtk.data.tokenize import check_tokenizer, tokenize

DTYPES = (np.uint8, np.uint16, np.uint32)


def input_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise UserError(f"--input {path}: no such file or folder")
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise UserError(f"--input {path}: the folder holds no files")
    kinds = {p.suffix == ".npy" for p in files}
    if len(kinds) > 1:
        raise UserError(f"--input {path}: mixes .npy token arrays and text files; give one kind per dataset")
    return files


Fields = dict[str, Any]


def read_tokens(files: list[Path], seq_len: int | None, tokenizer: str | None = None) -> tuple[np.ndarray, Fields, Fields, int]:
    """(rows of seq_len + 1 tokens, the manifest's tokenizer fields that are part of the
    version and those that are not, vocabulary size)."""
    if files[0].suffix != ".npy":
        tok = tokenize(files, tokenizer or "bytes")
        rows = _rows(tok.ids, 64 if seq_len is None else seq_len, files[0].parent)
        return rows, {"tokenizer": tok.name, **tok.header}, tok.about, tok.vocab_size
    if tokenizer is not None:
        raise UserError(f"--tokenizer {tokenizer}: the input is .npy token ids, already tokenized; leave --tokenizer out")
    parts = []
    for p in files:
        try:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise UserError(f"--input {p}: not a plain .npy array ({exc})") from None
        if not np.issubdtype(arr.dtype, np.integer):
            raise UserError(f"--input {p}: dtype {arr.dtype}; token ids must be integers")
        if arr.size and int(arr.min()) < 0:
            raise UserError(f"--input {p}: holds negative token ids")
        if arr.ndim == 1:
            parts.append(_rows(np.asarray(arr), 64 if seq_len is None else seq_len, p))
        elif arr.ndim == 2:
            if seq_len is not None and arr.shape[1] != seq_len + 1:
                raise UserError(
                    f"--input {p}: rows of {arr.shape[1]} tokens, but --seq-len {seq_len} needs {seq_len + 1}"
                    f" (omit --seq-len to use {arr.shape[1] - 1})"
                )
            seq_len = arr.shape[1] - 1
            parts.append(np.asarray(arr))
        else:
            raise UserError(f"--input {p}: a {arr.ndim}-D array; expected 1-D (a token stream) or 2-D (samples)")
    widths = {r.shape[1] for r in parts}
    if len(widths) > 1:
        raise UserError(f"--input: the files hold samples of different lengths {sorted(widths)}")
    rows = np.concatenate(parts)
    return rows, {"tokenizer": "none"}, {}, int(rows.max()) + 1 if rows.size else 0


def _rows(stream: np.ndarray, seq_len: int, source: Path) -> np.ndarray:
    if seq_len < 1:
        raise UserError(f"--seq-len {seq_len}: expected a positive integer")
    width = seq_len + 1
    n = len(stream) // width
    if n == 0:
        raise UserError(f"--input {source}: {len(stream)} tokens, fewer than one sample of {width} (--seq-len {seq_len} + 1)")
    return stream[: n * width].reshape(n, width)


def smallest_dtype(vocab_size: int) -> np.dtype:
    for dt in DTYPES:
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise UserError(f"token ids up to {vocab_size - 1} do not fit 32 bits")


def content_version(rows: np.ndarray, header: dict[str, Any]) -> str:
    """A hash of the layout and every token: equal content, equal version."""
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for start in range(0, len(rows), 1 << 16):
        h.update(np.ascontiguousarray(rows[start : start + (1 << 16)]).tobytes())
    return h.hexdigest()[:16]


def write_shard(path: Path, rows: np.ndarray) -> None:
    import h5py

    # No timestamps and a contiguous, uncompressed layout: identical bytes for identical
    # tokens, and readers can map the rows straight from the file.
    with h5py.File(path, "w", libver="earliest", track_order=False) as f:
        f.create_dataset(TOKENS, data=rows, track_times=False)
        f.flush()
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def dataset_files(folder: Path) -> set[str] | None:
    """The names of the files a dataset folder made by `prepare` consists of (its manifest
    and the shards it lists), or None when `folder` holds no dtk dataset manifest."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and isinstance(s.get("file"), str) for s in shards):
        return None
    return {MANIFEST, *(s["file"] for s in shards)}


def check_out(dst: Path, *, force: bool) -> Path:
    """The folder to write: `dst` when it is new or empty; with `force`, a dataset folder
    that `prepare` made and that holds nothing else. Anything else in it is the user's,
    and a user's folder is never renamed or deleted. A link is followed, so the dataset
    is replaced where it lives."""
    if dst.is_symlink():
        dst = dst.resolve()
    if not dst.exists():
        return dst
    if not dst.is_dir():
        raise UserError(f"--out {dst}: exists and is not a folder; choose a new folder")
    present = {p.name for p in dst.iterdir()}
    if not present:
        return dst
    ours = dataset_files(dst)
    if ours is None:
        raise UserError(f"--out {dst}: holds files and no dtk dataset {MANIFEST}; --force replaces only a dataset"
                        " folder made by dtk.data prepare; choose a new folder")
    others = sorted(present - ours)
    if others:
        raise UserError(f"--out {dst}: holds {others[0]!r}, which is not part of the dataset; --force replaces only"
                        " a folder of dataset files; move it out or choose a new folder")
    if not force:
        raise UserError(f"--out {dst}: holds a dataset already; choose a new folder, or pass --force to replace it")
    return dst


def check_val_fraction(val_fraction: float | None) -> None:
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction}: expected a fraction between 0 and 1 (exclusive), like 0.1")


def val_count(num_rows: int, val_fraction: float | None) -> int:
    """Samples of the validation split: at least one, and at least one left to train on."""
    if val_fraction is None:
        return 0
    num_val = int(round(num_rows * val_fraction))
    if num_val < 1 or num_val >= num_rows:
        raise UserError(f"--val-fraction {val_fraction}: of {num_rows} samples that leaves {num_val} for validation"
                        f" and {num_rows - num_val} for training; each needs one or more (more text, or another F)")
    return num_val


def write_shards(tmp: Path, rows: np.ndarray, prefix: str, samples_per_shard: int) -> list[dict[str, Any]]:
    shards = []
    for i, start in enumerate(range(0, len(rows), samples_per_shard)):
        name = f"{prefix}_{i:05d}.h5"
        part = rows[start : start + samples_per_shard]
        write_shard(tmp / name, part)
        shards.append(
            {"file": name, "num_samples": len(part), "size": (tmp / name).stat().st_size, "crc32": file_checksum(tmp / name)}
        )
    return shards


def prepare(input_path: str | Path, out: str | Path, *, seq_len: int | None = None,
            samples_per_shard: int = 16384, force: bool = False, tokenizer: str | None = None,
            val_fraction: float | None = None) -> dict[str, Any]:
    """Write the dataset folder `out` and return its manifest. The folder appears whole or
    not at all (built beside it, then renamed)."""
    src, dst = Path(input_path).expanduser(), Path(out).expanduser()
    if samples_per_shard < 1:
        raise UserError(f"--samples-per-shard {samples_per_shard}: expected a positive integer")
    check_val_fraction(val_fraction)
    if tokenizer is not None:
        check_tokenizer(tokenizer)
    dst = check_out(dst, force=force)
    rows, versioned, about, vocab = read_tokens(input_files(src), seq_len, tokenizer)
    num_val = val_count(len(rows), val_fraction)
    dtype = smallest_dtype(vocab)
    rows = rows.astype(dtype, copy=False)
    header = {"format": FORMAT, "seq_len": rows.shape[1] - 1, "dtype": dtype.name, **versioned}
    if num_val:
        header["val_samples"] = num_val  # the same tokens split otherwise are another dataset
    version = content_version(rows, header)

    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # The validation split is the end of the corpus: contiguous text the training split never saw.
    shards = write_shards(tmp, rows[: len(rows) - num_val], "shard", samples_per_shard)
    val_shards = write_shards(tmp, rows[len(rows) - num_val :], "val", samples_per_shard) if num_val else []
    manifest = {
        **header,
        **about,
        "version": version,
        "vocab_size": vocab,
        "num_samples": len(rows),
        "shards": shards + val_shards,
    }
    if val_shards:
        manifest["val_shards"] = [s["file"] for s in val_shards]
    with open(tmp / MANIFEST, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        dst.rename(old)
        tmp.rename(dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(dst)
    return manifest
