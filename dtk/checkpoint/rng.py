"""Each rank's random streams (Python, NumPy, torch, CUDA) in a checkpoint: plain tensors
only, so the file loads with `torch.load(weights_only=True)` (nothing in a checkpoint is
ever unpickled as arbitrary objects), written and fsynced before the manifest lists it."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import torch

from dtk.common.storage import LocalStorage, Storage

RankState = tuple[Callable[[], dict[str, torch.Tensor]], Callable[[dict[str, torch.Tensor]], None]]
_KEPT: dict[str, RankState] = {}


def keep_rank_state(name: str, save: Callable[[], dict[str, torch.Tensor]],
                    restore: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Keep a state of this rank's own beside its random streams, under `name/` in the same
    file: PowerSGD's error feedback (dtk.parallel.compression), which differs on every rank
    and, like a rank's stream, means something only to the same rank of the same world size.
    `save` returns copies as plain tensors; `restore` takes them back at a resume."""
    _KEPT[name] = (save, restore)


def rng_state() -> dict[str, torch.Tensor]:
    """This rank's random streams as plain tensors, so the file loads with weights_only=True
    (no pickle of arbitrary objects is ever unpickled from a checkpoint)."""
    import random

    import numpy as np

    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert kind == "MT19937" and isinstance(keys, np.ndarray), kind
    state = {
        "python_version": torch.tensor([version], dtype=torch.int64),
        "python_words": torch.tensor(words, dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss, gauss is not None], dtype=torch.float64),
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy_cached": torch.tensor([cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    for name, (save, _) in _KEPT.items():
        state.update({f"{name}/{key}": t for key, t in save().items()})
    return state


def save_rng(path: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """`state` (default: the streams now), written and fsynced before the manifest can list it."""
    with open(path, "wb") as fh:
        torch.save(rng_state() if state is None else state, fh)
        fh.flush()
        os.fsync(fh.fileno())


def save_rng_to(store: Storage, name: str, state: dict[str, torch.Tensor]) -> None:
    """`save_rng` into a checkpoint folder of any storage (one PUT in an object store)."""
    if isinstance(store, LocalStorage):
        save_rng(store.path / name, state)
        return
    buf = io.BytesIO()
    torch.save(state, buf)
    store.write_bytes(name, buf.getvalue())


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    import random

    import numpy as np

    gauss, has = state["python_gauss"].tolist()
    random.setstate((int(state["python_version"][0]), tuple(state["python_words"].tolist()), gauss if has else None))
    pos, has_gauss = state["numpy_pos"].tolist()
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss,
                         float(state["numpy_cached"][0])))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for name, (_, restore) in _KEPT.items():
        kept = {key.partition("/")[2]: t for key, t in state.items() if key.startswith(f"{name}/")}
        if kept:  # a checkpoint written without it (another scheme) leaves the state as it starts
            restore(kept)
