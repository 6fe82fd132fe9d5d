"""A run's name and hash, and the run directory an earlier release made for the same command.

New runs are named `<model>-<identity_hash>` (dtk/config/identity.py). A run directory
made by v0.1.0 or earlier carries that release's hash (dtk/config/identity_v0.py) in its
name and in its plan.json, and its checkpoints record it: where such a directory exists for
this config, the run keeps it, name and hash both, so the same command resumes it after an
upgrade. docs/recovery.md, "Identity and upgrades".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtk.common.rundir import PLAN_JSON
from dtk.config.identity import identity_hash
from dtk.config.identity_v0 import v0_hash


def model_name(target: str) -> str:
    """"dtk.models.transformer.build" -> "transformer": the module says more than "build"."""
    parts = target.split(".")
    name = parts[-2] if len(parts) >= 2 and parts[-1] in ("build", "create", "make") else parts[-1]
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in name.lower()) or "model"


def run_identity(cfg: Any, root: Path) -> tuple[str, str]:
    """(run name, config hash) of this config under `root`. The current rule's, unless a run
    directory of an earlier release holds this config: then that directory's."""
    digest = identity_hash(cfg)
    prefix = model_name(cfg.model._target_)
    name = cfg.run.name or f"{prefix}-{digest}"
    if recorded_hash(root / name) is not None:
        return _kept(root / name, name, digest, cfg)
    old = v0_hash(cfg)
    if old is None:
        return name, digest
    if cfg.run.name is None and recorded_hash(root / f"{prefix}-{old}") == old:
        return f"{prefix}-{old}", old
    return name, digest


def _kept(path: Path, name: str, digest: str, cfg: Any) -> tuple[str, str]:
    """A directory of this name exists: it keeps the hash it recorded where that is this
    config's under either rule (else the launch refuses the mix, by the current hash)."""
    recorded = recorded_hash(path)
    if recorded != digest and recorded is not None and recorded == v0_hash(cfg):
        return name, recorded
    return name, digest


def recorded_hash(run_dir: Path) -> str | None:
    """The config hash a run directory's plan.json records (None: none readable)."""
    try:
        value = json.loads((run_dir / PLAN_JSON).read_text()).get("config_hash")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
