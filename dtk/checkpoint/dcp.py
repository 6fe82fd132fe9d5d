"""Sharded checkpoints with torch.distributed.checkpoint, committed by a manifest.

Layout of one checkpoint (see dtk.rundir):

    checkpoints/step_00000050/
        __0_0.distcp ...      DCP shards: model and optimizer, keys independent of the scheme
        .metadata             DCP's index
        rng_00000.pt ...      each rank's RNG states
        trainer.json          step, data position, scheduler, world size, config hash
        manifest.json         written last, atomically: the checkpoint exists once this does

Model and optimizer go through `get_state_dict`/`set_state_dict` with flattened optimizer
state, so every key is a parameter's original name (no `module.` prefix, no sharding, no
pipeline stage): a checkpoint written under one scheme and world size loads under another.
A rank may hold several model parts (pipeline stages), each with its own optimizer.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from dtk.rundir import MANIFEST, RunDir, write_json_atomic

TRAINER_STATE = "trainer.json"
FORMAT_VERSION = 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


Parts = list[tuple[torch.nn.Module, torch.optim.Optimizer]]
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state_dicts(parts: Parts) -> tuple[dict[str, Any], dict[str, Any], list[tuple[set, set]]]:
    """Merged model and optimizer state of all parts, plus each part's own keys."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    keys = []
    for module, optimizer in parts:
        m, o = get_state_dict(module, optimizer, options=_OPTIONS)
        assert not (m.keys() & model_sd.keys()), "model parts share parameter names"
        model_sd.update(m)
        optim_sd.update(o)
        keys.append((set(m), set(o)))
    return model_sd, optim_sd, keys


def save(path: Path, *, parts: Parts, trainer_state: dict[str, Any]) -> dict[str, Any]:
    """Collective: every rank calls it. Returns the manifest (on every rank)."""
    started = time.perf_counter()
    rank = _rank()
    if rank == 0:
        if path.exists():  # left by a save that was killed before its manifest
            shutil.rmtree(path)
        path.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd, _ = _state_dicts(parts)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    torch.save(_rng_state(), path / f"rng_{rank:05d}.pt")
    _barrier()
    manifest: dict[str, Any] = {}
    if rank == 0:
        write_json_atomic(path / TRAINER_STATE, trainer_state)
        files = {
            p.name: {"size": p.stat().st_size}
            for p in sorted(path.iterdir())
            if p.is_file() and p.name != MANIFEST and not p.name.startswith(".manifest")
        }
        manifest = {
            "format": FORMAT_VERSION,
            "step": trainer_state["step"],
            "world_size": trainer_state["world_size"],
            "config_hash": trainer_state["config_hash"],
            "save_seconds": round(time.perf_counter() - started, 4),
            "files": files,
        }
        write_json_atomic(path / MANIFEST, manifest)  # the commit point
    _barrier()
    return manifest


def load(path: Path, *, parts: Parts) -> dict[str, Any]:
    """Collective: load model and optimizer (resharded to the current layout) and return the
    trainer state. This rank's RNG is restored when the world size is unchanged."""
    model_sd, optim_sd, keys = _state_dicts(parts)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    for (module, optimizer), (mkeys, okeys) in zip(parts, keys, strict=True):
        set_state_dict(
            module,
            optimizer,
            model_state_dict={k: state["model"][k] for k in mkeys},
            optim_state_dict={k: state["optim"][k] for k in okeys},
            options=_OPTIONS,
        )
    trainer_state = json.loads((path / TRAINER_STATE).read_text())
    rng_file = path / f"rng_{_rank():05d}.pt"
    if trainer_state["world_size"] == (dist.get_world_size() if dist.is_initialized() else 1) and rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state


def latest_complete(run: RunDir) -> tuple[int, Path] | None:
    complete = [(step, p) for step, p, ok in run.checkpoint_steps() if ok]
    return complete[-1] if complete else None


def prune(run: RunDir, keep: int) -> list[Path]:
    """Rank 0 only: keep the newest `keep` complete checkpoints; drop older ones and any
    incomplete folder older than the newest complete one (left by a killed save)."""
    found = run.checkpoint_steps()
    complete = [p for _, p, ok in found if ok]
    if not complete:
        return []
    newest = max(step for step, _, ok in found if ok)
    doomed = complete[:-keep] + [p for step, p, ok in found if not ok and step < newest]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
