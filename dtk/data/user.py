"""A dataset of the user's own: `data._target_` names a function that returns a map-style
dataset (`__len__`, `__getitem__(i)` -> a tensor, an array, a number, or a tuple / dict of
them), or a pair (train, validation) of them, or a dict with keys `train` and `validation`.

dtk keeps for it everything it promises for its own data:

- the same world-size-invariant order (dtk.data.order): global batch k is the same sample
  ids on 1, 2 or 64 data-parallel ranks, and a resume continues at the exact sample;
- read-ahead: the loader thread calls `__getitem__` for the next steps while one computes;
- a fixed split: the function's own validation set, or `data.val_fraction` of the samples
  drawn with `data.split_seed`; the split is written to RUN_DIR/data.json;
- a version, recorded in every checkpoint and checked on resume: `data.version`, else the
  dataset's `version` attribute, else a hash of its length and of a sample of its items
  (the first, the last and evenly spaced ones), so changed data is refused, not trained on.

Samples are stacked into batches of the same structure (tuples stay tuples). No torch
import at module level: the login node imports this module to check a config.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtk.common.errors import UserError

NUM_PROBES = 16


def locate(target: str, key: str = "data._target_") -> Callable[..., Any]:
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise UserError(f"{key}={target}: expected a dotted path like package.module.function")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(
            f"{key}={target}: cannot import it ({exc}); run from the project folder, or give it with --config-dir"
        ) from None


def collate(samples: list[Any]) -> Any:
    """Stack samples of one structure into a batch of that structure (tensors along dim 0)."""
    import torch

    first = samples[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(samples)
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(samples))
    if isinstance(first, (bool, int, float, np.number)):
        return torch.tensor(np.asarray(samples))
    if isinstance(first, Mapping):
        return {k: collate([s[k] for s in samples]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(collate([s[i] for s in samples]) for i in range(len(first)))
    if isinstance(first, (str, bytes)):
        return list(samples)
    raise UserError(
        f"a sample of type {type(first).__name__}: a dataset item must be a tensor, an array, a number, or a"
        " tuple / dict of them"
    )


def _leaf_bytes(value: Any, out: Any) -> None:
    """Feed a sample's content (its structure, dtypes, shapes and values) to a hash."""
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    if isinstance(value, np.ndarray):
        out.update(f"{value.dtype}{value.shape}".encode())
        out.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        for k in sorted(value, key=str):
            out.update(f"[{k}]".encode())
            _leaf_bytes(value[k], out)
    elif isinstance(value, (tuple, list)):
        out.update(f"({len(value)}".encode())
        for v in value:
            _leaf_bytes(v, out)
    else:
        out.update(repr(value).encode())


def fingerprint(dataset: Any) -> str:
    """A hash of the dataset's length and of a sample of its items."""
    n = len(dataset)
    ids = sorted({0, n - 1, *(i * n // NUM_PROBES for i in range(NUM_PROBES))}) if n else []
    digest = hashlib.blake2b(f"len={n}".encode(), digest_size=8)
    for i in ids:
        digest.update(f"#{i}".encode())
        _leaf_bytes(dataset[i], digest)
    return f"sha-{digest.hexdigest()}"


class MapDataset:
    """A user's map-style dataset as dtk's loader reads it: `get(ids)` returns the batch."""

    def __init__(self, dataset: Any, *, version: str) -> None:
        self.dataset = dataset
        self.version = version
        self.split: Split | None = None  # the training set's: how the user's samples were split

    def __len__(self) -> int:
        return len(self.dataset)

    def get(self, ids: np.ndarray) -> Any:
        return collate([self.dataset[int(i)] for i in ids])


class Subset:
    """Some items of a dataset, renumbered 0..n-1 (one side of a split)."""

    def __init__(self, base: Any, indices: np.ndarray) -> None:
        self.base, self.indices = base, np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.base[int(self.indices[i])]


@dataclass(frozen=True)
class Split:
    """How the training and validation sets came about; written to RUN_DIR/data.json."""

    target: str
    version: str
    num_train: int
    num_validation: int
    source: str
    """`function` (the function returned both sets) or `val_fraction`."""
    val_fraction: float
    split_seed: int
    validation_ids: str
    """A hash of the validation sample ids within the function's dataset (val_fraction only)."""


def _check(dataset: Any, what: str, target: str) -> None:
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise UserError(
            f"data._target_={target} returned {type(dataset).__name__} as {what}: expected a map-style dataset"
            " (__len__ and __getitem__)"
        )


def build_user_splits(
    *, target: str, kwargs: dict[str, Any], val_fraction: float, split_seed: int, version: str | None
) -> tuple[MapDataset, MapDataset, Split]:
    """(train, validation, split) of `data._target_`, identical on every rank and restart."""
    made = locate(target)(**kwargs)
    if isinstance(made, Mapping):
        missing = {"train", "validation"} - set(made)
        if missing:
            raise UserError(f"data._target_={target} returned a dict without {sorted(missing)}; give train and validation")
        made = (made["train"], made["validation"])
    if isinstance(made, tuple):
        if len(made) != 2:
            raise UserError(f"data._target_={target} returned {len(made)} datasets; expected one, or (train, validation)")
        train, val = made
        _check(train, "training set", target)
        _check(val, "validation set", target)
        source, ids_hash = "function", ""
    else:
        _check(made, "dataset", target)
        if not 0 <= val_fraction < 1:
            raise UserError(f"data.val_fraction={val_fraction}: expected a fraction in [0, 1)")
        n = len(made)
        perm = np.random.default_rng([split_seed, 0x5EED]).permutation(n)
        num_val = int(round(n * val_fraction))
        val_ids, train_ids = np.sort(perm[:num_val]), np.sort(perm[num_val:])
        train, val = Subset(made, train_ids), Subset(made, val_ids)
        source = "val_fraction"
        ids_hash = hashlib.blake2b(val_ids.tobytes(), digest_size=8).hexdigest()
    if len(train) == 0:
        raise UserError(f"data._target_={target}: the training set is empty")
    # The version covers both sets: either changing is changed data.
    own = version or getattr(made if not isinstance(made, tuple) else train, "version", None)
    data_version = str(own) if own else f"{fingerprint(train)}-{fingerprint(val)}"
    split = Split(
        target=target,
        version=data_version,
        num_train=len(train),
        num_validation=len(val),
        source=source,
        val_fraction=val_fraction if source == "val_fraction" else 0.0,
        split_seed=split_seed,
        validation_ids=ids_hash,
    )
    return MapDataset(train, version=data_version), MapDataset(val, version=f"{data_version}-val"), split
