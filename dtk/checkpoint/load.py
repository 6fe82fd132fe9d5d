"""Verify and load a checkpoint, with every rank agreeing on the outcome.

Two ways a load can go wrong, and they end differently:

- verification fails (no manifest, a missing, short or changed file): `mf.Rejected` - the
  checkpoint is corrupt, the manager logs `checkpoint_rejected` and tries the previous one;
- anything else (out of memory, an I/O error, a permission): `CheckpointLoadError` - the
  checkpoint is fine and is kept; the job stops with the cause, since falling back to an
  older checkpoint would throw work away and retention would later delete the good one.

Each phase runs on every rank and then the ranks agree (a gather on the checkpoint's own
group), so a failure on one rank is the same exception with the same cause on all of them:
no rank falls through to another checkpoint or starts training while the others stop.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import _get_fqns, set_state_dict

from dtk.checkpoint import manifest as mf
from dtk.checkpoint.reading import HashingReader
from dtk.checkpoint.rng import set_rng_state
from dtk.checkpoint.safe import SafeLoadPlanner
from dtk.checkpoint.sharded import _OPTIONS, TRAINER_STATE, Comm, Parts, _state_dicts, cause, rng_file
from dtk.checkpoint.trust import check_metadata, read_checked
from dtk.models.ties import module_keys


class CheckpointLoadError(RuntimeError):
    """A checkpoint that verified could not be loaded; every rank raises it with one cause."""


def _agree(comm: Comm, path: Path, fn: Callable[[], Any]) -> Any:
    """`fn()` on every rank; CheckpointLoadError on all of them when it failed on any."""
    result, problem = None, None
    try:
        result = fn()
    except mf.Rejected as exc:  # a verification verdict, not an accident: agreed elsewhere
        problem = ("rejected", str(exc))
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        problem = ("failed", cause(exc, rank=comm.rank if comm.world_size > 1 else None))
    problems = [p for p in comm.all_gather(problem) if p]
    rejected = [why for kind, why in problems if kind == "rejected"]
    failed = [why for kind, why in problems if kind == "failed"]
    if rejected:  # a corrupt file explains a failure elsewhere (DCP raises one rank's failure on all)
        raise mf.Rejected(rejected[0])
    if failed:
        raise CheckpointLoadError(f"checkpoint {path.name} could not be read: {failed[0]}")
    return result


def verify(comm: Comm, path: Path, *, checksums: bool = True) -> dict[str, Any]:
    """Collective: the manifest of a checkpoint whose files all match it, else mf.Rejected on
    every rank (CheckpointLoadError when a file could not be read at all). Ranks share the
    checksum reading, and rank 0 checks `.metadata` as DCP metadata only. `checksums=False`:
    the manifest and file sizes only, no file read (a resume checks the CRCs and `.metadata`
    while loading: `load`)."""

    def read() -> dict[str, Any] | None:
        if comm.rank != 0:
            return None
        manifest = mf.read_manifest(path)
        problems = mf.check_sizes(path, manifest)
        if problems:
            raise mf.Rejected(mf.summarize(problems))
        return manifest

    manifest = comm.broadcast(_agree(comm, path, read))
    if checksums:
        _check_checksums(comm, path, manifest, sorted(manifest["files"]))
        _agree(comm, path, lambda: check_metadata(path, manifest) if comm.rank == 0 else None)
    return manifest


def _check_checksums(comm: Comm, path: Path, manifest: dict[str, Any], names: list[str]) -> None:
    """Collective: read `names` for their CRCs, shared among the ranks; mf.Rejected on every
    rank when one differs from the manifest."""
    problems = _agree(comm, path, lambda: mf.check_checksums(path, manifest, names[comm.rank :: comm.world_size]))
    every = [p for share in comm.all_gather(problems) for p in share]
    if every:
        raise mf.Rejected(mf.summarize(every))


def allocate_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata) -> bool:
    """Give an optimizer without state the tensors its checkpointed state loads into, shaped
    and typed as `.metadata` lists them (uninitialised: the load fills every one). Without
    them, torch's get_state_dict creates the state by running a whole optimizer step on zero
    gradients - for AdamW as long as a training step's update, spent before the first byte
    is read. Only where each trainable parameter is a plain tensor whose every state entry
    is a tensor in the checkpoint; otherwise (DTensor shards, another optimizer's state, a
    value stored as bytes) nothing is touched and torch's way applies. Returns whether it
    allocated."""
    if optimizer.state:
        return False
    fqns = {id(p): _get_fqns(module, name) for name, p in module.named_parameters()}
    entries = metadata.state_dict_metadata
    planned: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not param.requires_grad:
                continue
            names = fqns.get(id(param))
            if type(param.data) is not torch.Tensor or names is None or len(names) != 1:
                return False
            prefix = f"optim.state.{next(iter(names))}."
            found: dict[str, TensorStorageMetadata] = {}
            for key, entry in entries.items():
                if key.startswith(prefix):
                    if "." in key[len(prefix):] or not isinstance(entry, TensorStorageMetadata):
                        return False
                    found[key[len(prefix):]] = entry
            if not found:
                return False
            # a 0-dim entry (AdamW's step) on the CPU, as torch keeps it unless capturable or fused
            # (the optimizer's load_state_dict moves it then); the rest beside the parameter
            planned[param] = {k: torch.empty(e.size, dtype=e.properties.dtype,
                                             device=param.device if len(e.size) else "cpu")
                              for k, e in found.items()}
    optimizer.state.update(planned)
    return bool(planned)


def set_parts(parts: Parts, keys: list[tuple[set, set]], state: dict[str, Any]) -> None:
    """Hand each part (a module and its optimizer) its keys of the loaded flat state."""
    for (module, optimizer), (mkeys, okeys) in zip(parts, keys, strict=True):
        model_state = {k: state["model"][k] for k in mkeys}
        optim_state = {k: state["optim"][k] for k in okeys}
        module_keys(module, model_state, optim_state)  # a tied weight's names, from its first one
        set_state_dict(
            module,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=_OPTIONS,
        )


def load(path: Path, *, parts: Parts, comm: Comm, manifest: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Collective: load model and optimizer (resharded to the current layout); return the
    trainer state and whether this rank's RNG was restored (only when the world size is
    unchanged: a rank's stream means nothing to another layout). CheckpointLoadError on
    every rank when any rank failed.

    The files' CRCs are checked on the way (dtk.checkpoint.reading), and the files no rank
    read whole after it: mf.Rejected on every rank when one differs from `manifest`, before
    the state is applied to the optimizer and the RNG."""
    reader = HashingReader(path, manifest=manifest)

    def prepare() -> tuple[dict[str, Any], dict[str, Any], list[tuple[set, set]]]:
        # .metadata first, checked and parsed as DCP metadata only (Rejected here, not wrapped by DCP)
        metadata = reader.read_metadata()
        for module, optimizer in parts:
            allocate_optimizer_state(module, optimizer, metadata)
        return _state_dicts(parts)

    model_sd, optim_sd, keys = _agree(comm, path, prepare)
    state = {"model": model_sd, "optim": optim_sd}

    def read() -> None:
        # DCP gathers every rank's read result: a failed read raises on all ranks.
        try:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=comm.group,
                     no_dist=comm.group is None)
        except (Exception, CheckpointException) as exc:
            bad = reader.mismatches(manifest)
            if bad:
                raise mf.Rejected(mf.summarize(bad)) from exc
            if reader.rejection:
                raise mf.Rejected(reader.rejection) from exc
            raise
        bad = reader.mismatches(manifest)
        if bad:
            raise mf.Rejected(mf.summarize(bad))

    _agree(comm, path, read)
    hashed = {name for share in comm.all_gather(sorted(reader.crcs)) for name in share}
    _check_checksums(comm, path, manifest, sorted(set(manifest["files"]) - hashed))

    def apply() -> tuple[dict[str, Any], bool]:
        # The small files first, parsed from the bytes that matched the manifest (read once),
        # so a rejection here leaves the model untouched.
        trainer_state = json.loads(read_checked(path, TRAINER_STATE, manifest))
        rng_name, rng = rng_file(comm.rank), None
        if trainer_state["world_size"] == comm.world_size and rng_name in manifest["files"]:
            rng = torch.load(io.BytesIO(read_checked(path, rng_name, manifest)), weights_only=True)
        set_parts(parts, keys, state)
        if rng is not None:
            set_rng_state(rng)
        return trainer_state, rng is not None

    return _agree(comm, path, apply)
