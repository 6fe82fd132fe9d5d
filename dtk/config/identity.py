"""Run identity: which keys make a run what it is, and the hash that names it.

A schema field whose metadata holds `identity=True` (`IDENTITY`, dtk/config/fields.py) is
part of what a run computes: the model's architecture and initialisation, the data and its
version, the optimizer's math and schedule, the steps, the global batch, the seed. Every other key
(evaluation, logging, checkpoint cadence, sharding units, nodes, scheme, workers) says how
or where it is computed, and never forks a run.

The hash covers only the identity fields whose value differs from their schema default, so
a release that adds a defaulted field renames no run. A user model has no schema: every
keyword argument of its factory is identity. docs/recovery.md, "Identity and upgrades".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from dtk.config.convert import builtin_transformer, plain
from dtk.config.fields import field_default, is_identity

# The sections that hold identity fields, in the typed config (after compose()).
IDENTITY_SECTIONS = ("data", "task", "optim", "train")


def identity_values(cfg: Any) -> dict[str, Any]:
    """{dotted key: plain value} of the identity fields that differ from their defaults."""
    out: dict[str, Any] = {}
    model = cfg.model
    transformer = builtin_transformer(model)
    if transformer is not None:
        # The built-in transformer's keys have a schema: its defaults say what is not hashed.
        _differing(transformer, "model", out)
    else:
        # A user model's yaml has no schema: each of its factory's arguments is identity.
        out["model._target_"] = model._target_
        out.update({f"model.{k}": plain(v) for k, v in model.kwargs.items()})
    for section in IDENTITY_SECTIONS:
        _differing(getattr(cfg, section), section, out)
    _differing(cfg.scheme, "scheme", out)  # its few identity keys (grad_compression): how the rest never forks
    if cfg.sync is not None:  # +sync=MODE: a run of its own, whatever its values; the rest as any section's
        out["sync.mode"] = plain(cfg.sync.mode)
        _differing(cfg.sync, "sync", out)
    return out


def _differing(section: Any, prefix: str, out: dict[str, Any]) -> None:
    for f in dataclasses.fields(section):
        if not is_identity(f):
            continue
        value, default = plain(getattr(section, f.name)), field_default(f)
        if default is dataclasses.MISSING or value != plain(default):
            out[f"{prefix}.{f.name}"] = value


def identity_hash(cfg: Any) -> str:
    """Ten hex digits of the identity fields that differ from their defaults."""
    blob = json.dumps(identity_values(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]
