"""One consolidated model from a sharded checkpoint, for inference or another framework.

The default file is a plain `torch.save`d state dict of the model - the parameter names of
the unwrapped model, full tensors, no optimizer - so

    model.load_state_dict(torch.load(FILE))

works on one process without dtk's parallel wrappers; `--format safetensors` writes the
same tensors as a safetensors file, `--format hf` a folder transformers loads (see
dtk.checkpoint.formats). A JSON sidecar `OUT.json` says where it came from (run, step,
model config, data version, checkpoint manifest). A tied weight (an output head that is
the token embedding) is one tensor in the checkpoint; the torch and safetensors files hold
it under each of its names, as the model's `load_state_dict` expects (`tied` in the
sidecar: later name -> first).

It needs no process group, and no model code for the tensors: their shapes and dtypes
come from DCP's own metadata, and DCP assembles each one from however many shards it was
saved in (the model is built on the meta device only to learn its tied names).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtk.checkpoint.formats import FORMATS, size_of, write_file, write_hf
from dtk.checkpoint.manifest import Rejected, verify
from dtk.checkpoint.reading import HashingReader
from dtk.checkpoint.safe import SafeLoadPlanner, SafeReader
from dtk.common.errors import UserError, check_out
from dtk.common.rundir import RunDir, write_json_atomic
from dtk.common.storage import Storage, checkpoint_steps, checkpoints_of, local_path
from dtk.config.convert import model_to_dict
from dtk.plan.plan import Plan

PREFIX = "model."


def choose(run: RunDir, step: int | None) -> tuple[int, Path | Storage, dict[str, Any]]:
    """The newest checkpoint that verifies, or the one of `step` (which must verify)."""
    store = checkpoints_of(run)  # checkpoint.dir: the run's checkpoints/ folder, or an object store
    found = [(s, local_path(folder)) for s, folder, _ in checkpoint_steps(store)]  # local: read as files
    if not found:
        raise UserError(f"RUN_DIR {run.path}: no checkpoints in {store}")
    if step is not None:
        match = [(s, p) for s, p in found if s == step]
        if not match:
            raise UserError(f"--step {step}: no checkpoint of that step in {run.path} (steps: {', '.join(str(s) for s, _ in found)})")
        try:
            return step, match[0][1], verify(match[0][1])
        except Rejected as exc:
            raise UserError(f"--step {step}: the checkpoint does not verify ({exc})") from None
    reasons = []
    for s, p in reversed(found):
        try:
            return s, p, verify(p)
        except Rejected as exc:
            reasons.append(f"step {s}: {exc}")
    raise UserError(f"RUN_DIR {run.path}: no checkpoint verifies ({'; '.join(reasons)})")


def load_model_state(path: Path | Storage, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full model tensors of a DCP checkpoint, on the CPU, by parameter name. Its
    `.metadata` is checked against `manifest` and parsed as DCP metadata only; Rejected
    otherwise (dtk.checkpoint.safe). In an object store every read goes through the
    storage (HashingReader: the same safe loading, and the CRCs of the files it reads whole)."""
    reader = SafeReader(path, manifest=manifest) if isinstance(path, Path) else HashingReader(path, manifest=manifest)
    metadata = reader.read_metadata()
    model: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(PREFIX) and isinstance(meta, TensorStorageMetadata):
            model[key[len(PREFIX) :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        raise UserError(f"{path}: the checkpoint holds no model tensors")
    state = {"model": model}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state["model"]


SYNCED = "synced."
"""A `+sync` run's checkpoint (dtk.train.sync.Anchor): the parameters as of the last
synchronization, under this prefix with `/` for `.`, beside each replica's own (`replicaN.`)."""


def synchronized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model of a checkpoint: a `+sync` run's last synchronized parameters, else all."""
    if not any(key.startswith(SYNCED) for key in tensors):
        return tensors
    return {key[len(SYNCED):].replace("/", "."): t for key, t in tensors.items() if key.startswith(SYNCED)}


def tied_names(model_cfg: dict[str, Any] | None) -> dict[str, str] | None:
    """Each later name of the run's model's tied weights -> the first, under which the
    checkpoint holds the tensor (dtk.checkpoint.sharded): from the model built on the meta
    device. None where it cannot be built here (a user's model whose code is not importable):
    the export then holds the checkpoint's names only, and says so in its sidecar."""
    if model_cfg is None:
        return None
    from dtk.config.convert import model_config
    from dtk.models.build import build_model
    from dtk.models.ties import tied_aliases

    try:
        with torch.random.fork_rng(devices=[]):  # build_model seeds the global generator
            return tied_aliases(build_model(model_config(model_cfg), device="meta", seed=0))
    except (UserError, ImportError):
        return None


def export(run_dir: str | Path, *, out: str | Path, step: int | None = None, fmt: str = "torch") -> dict[str, Any]:
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    run = RunDir(Path(run_dir))
    if not run.path.is_dir():
        raise UserError(f"RUN_DIR {run.path}: no such run directory")
    check_out(Path(out), folder=fmt == "hf")  # before the checkpoint is read
    model_cfg = None
    if run.plan_json.is_file():
        model_cfg = model_to_dict(Plan.read(run).config.model)
    step, path, manifest = choose(run, step)
    try:
        tensors = load_model_state(path, manifest)
    except Rejected as exc:  # changed since it verified a moment ago
        raise UserError(f"checkpoint {path}: {exc}") from None
    tensors = synchronized(tensors)
    counted = sum(t.numel() for t in tensors.values())  # a tied weight once, as the checkpoint holds it
    tied = tied_names(model_cfg)
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        write_hf(tensors, out, model_cfg=model_cfg)  # transformers ties the head itself
    else:
        # Every name the model's load_state_dict asks for; safetensors stores no shared tensors.
        copy = fmt == "safetensors"
        tensors |= {a: tensors[f].clone() if copy else tensors[f] for a, f in (tied or {}).items() if f in tensors}
        write_file(tensors, out, fmt=fmt)
    info = {
        "run": str(run.path),
        "step": step,
        "checkpoint": str(path),
        "model": model_cfg,
        "data_version": manifest.get("data_version"),
        "config_hash": manifest.get("config_hash"),
        "parameters": counted,
        "tied": tied,
        "tensors": len(tensors),
        "format": fmt,
        "bytes": size_of(out),
    }
    write_json_atomic(out.with_name(out.name + ".json"), info)
    return info
