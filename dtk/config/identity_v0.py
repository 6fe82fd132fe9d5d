"""The run hash of release v0.1.0 and earlier, frozen: whole `model`, `data` and `optim`
sections (defaults included), `train.steps`, `train.global_batch`, `train.seed`, and the
task's loss when it is a user's. Kept so that a run directory those releases named is found
again for the same command (dtk/plan/identity.py); never used to name a new run.

It hashes the sections as v0.1.0's schema spelled them (`V0_KEYS`): a key added since is
left out while it holds its default (the old release could not have had it otherwise), and a
key removed since is put back with the old default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from dtk.config.fields import field_default
from dtk.config.identity import identity_values

# v0.1.0's schema keys (with their defaults) of the sections its hash covered.
V0_PARALLEL: dict[str, Any] = {"wrap_classes": [], "tp_plan": {}, "split_points": []}
V0_TRANSFORMER = {"vocab_size": 256, "dim": 64, "num_layers": 2, "num_heads": 4, "ffn_hidden": 0, "seq_len": 64,
                  "norm_eps": 1e-5, "dropout": 0.0}
V0_DATA = {
    "synthetic": {"kind": "synthetic", "num_samples": 8192, "seed": 1234, "branching": 4, "eval_samples": 0},
    "hdf5": {"kind": "hdf5", "val_fraction": 0.05, "split_seed": 0, "val_shards": [], "eval_samples": 1024,
             "verify": False},
    "user": {"kind": "user", "kwargs": {}, "val_fraction": 0.1, "split_seed": 0, "version": None, "eval_samples": 0},
}
V0_REQUIRED_DATA = {"hdf5": ("path",), "user": ("_target_",)}  # keys without a default then
V0_OTHER = ("train.steps", "train.global_batch", "train.seed", "task._target_", "task.form", "task.inputs")
"""The identity keys v0.1.0 hashed outside its whole sections."""
V0_OPTIM = {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
            "warmup_steps": 20, "min_lr_ratio": 0.1, "grad_clip": 1.0}


class NotV0(Exception):
    """The config holds a key v0.1.0 did not have, at a value other than its default."""


def v0_hash(cfg: Any) -> str | None:
    """The hash v0.1.0 gave this config, or None where no config of v0.1.0 equals it."""
    from dtk.config.convert import builtin_transformer, plain, to_dict
    from dtk.config.schema import ModelParallelConfig, TransformerConfig

    raw = to_dict(cfg)
    try:
        model = dict(raw["model"])
        _as_v0(model, V0_PARALLEL, ModelParallelConfig)
        if builtin_transformer(cfg.model) is not None:
            _as_v0(model, V0_TRANSFORMER, TransformerConfig, ignore=("_target_", *V0_PARALLEL))
        data = dict(raw["data"])
        kind = data["kind"]
        _as_v0(data, V0_DATA[kind], type(cfg.data), ignore=V0_REQUIRED_DATA.get(kind, ()))
        optim = dict(raw["optim"])
        _as_v0(optim, V0_OPTIM, type(cfg.optim))
    except NotV0:
        return None
    if any(k.split(".")[0] not in ("model", "data", "optim") and k not in V0_OTHER for k in identity_values(cfg)):
        return None  # an identity key added since, set: no run of v0.1.0 computed this
    train = raw["train"]
    picked: dict[str, Any] = {"model": model, "data": data, "optim": optim, "train.steps": train["steps"],
                              "train.global_batch": train["global_batch"], "train.seed": train["seed"]}
    if cfg.task._target_ is not None:
        picked["task"] = {k: plain(getattr(cfg.task, k)) for k in ("_target_", "form", "inputs")}
    blob = json.dumps(picked, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def _as_v0(section: dict[str, Any], v0: dict[str, Any], schema: type, ignore: tuple[str, ...] = ()) -> None:
    """Turn one plain section into v0.1.0's spelling of it, in place."""
    from dtk.config.convert import plain

    for f in dataclasses.fields(schema):
        if f.name in v0 or f.name in ignore or f.name not in section:
            continue
        if section[f.name] != plain(field_default(f)):
            raise NotV0(f.name)
        del section[f.name]
    for key, default in v0.items():
        section.setdefault(key, default)
