"""The typed configuration after composition, and its plain form.

`compose()` ends in `finish`: OmegaConf.to_object has turned the composed node into the
schema dataclasses, and `finish` gives the three sections whose schema a group chooses
their one shape after composition, so no consumer ever asks "which kind is this?":

    model    a ModelConfig, whatever the model: `_target_`, the parallel keys, and the
             factory's keyword arguments as a dict (a user model's yaml has no schema)
    data     the schema of its `kind` (SyntheticDataConfig, Hdf5DataConfig, UserDataConfig; a
             section with `_target_` and no kind is a user's)
    scheme   a SchemeConfig; a job without `+scheme=` gets the schema's (DDP)

The plain form (`to_dict`) is what config.yaml and plan.json hold: the model flat, as its
yaml spells it, and closed-set values as their strings. `from_dict` reads it back through
the same schemas, so a plan read by a worker is typed and checked like a composed one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from enum import Enum
from typing import Any

from dtk.common.errors import UserError
from dtk.config.choices import DataKind
from dtk.config.hf_json import HF_TARGET, fill_vocab_size
from dtk.config.schema import (
    DATA_SCHEMAS,
    Config,
    Hdf5DataConfig,
    ModelConfig,
    ModelParallelConfig,
    SchemeConfig,
    SyntheticDataConfig,
    TransformerConfig,
    UserDataConfig,
)

PARALLEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelParallelConfig))


def finish(cfg: Config) -> Config:
    """Give `model`, `data` and `scheme` their after-composition shape (see the module doc)."""
    cfg.model = model_config(cfg.model)
    cfg.data = data_config(cfg.data)
    if cfg.model._target_ == HF_TARGET and cfg.data.kind == DataKind.synthetic:
        # Generated data takes the model's vocabulary (config.json) unless the yaml gives one.
        cfg.model.kwargs = fill_vocab_size(cfg.model.kwargs)
    if cfg.scheme is None:
        cfg.scheme = SchemeConfig()
    return cfg


def model_config(model: Any) -> ModelConfig:
    """A ModelConfig from the composed `model` section (a TransformerConfig or a user dict)."""
    if isinstance(model, ModelConfig):
        return model
    is_instance = dataclasses.is_dataclass(model) and not isinstance(model, type)
    flat = dataclasses.asdict(model) if is_instance else dict(model)
    target = flat.pop("_target_", None)
    if not isinstance(target, str) or not target:
        raise UserError(
            f"model._target_={target}: every model names its factory, e.g. _target_: package.module.build"
        )
    parallel = typed(ModelParallelConfig, {k: flat.pop(k) for k in PARALLEL_KEYS if k in flat}, prefix="model.")
    # Other keys starting with "_" are Hydra's (`_recursive_`, ...), never the factory's.
    kwargs = {k: v for k, v in flat.items() if not k.startswith("_")}
    return ModelConfig(_target_=target, kwargs=kwargs, **{k: getattr(parallel, k) for k in PARALLEL_KEYS})


TRANSFORMER_KEYS = frozenset(f.name for f in dataclasses.fields(TransformerConfig)) - {"_target_", *PARALLEL_KEYS}


def builtin_transformer(model: ModelConfig) -> TransformerConfig | None:
    """The built-in transformer's keys, typed, when the model section has exactly its keys
    (the transformer, or a factory of the user's that takes the same keys); else None."""
    if set(model.kwargs) != TRANSFORMER_KEYS:
        return None
    parallel = {k: getattr(model, k) for k in PARALLEL_KEYS}
    return TransformerConfig(_target_=model._target_, **model.kwargs, **parallel)


def data_config(data: Any) -> Any:
    """The data section typed by the schema its `kind` names; a kind that contradicts the
    chosen group's schema is refused (data=synthetic data.kind=hdf5 has no path)."""
    if isinstance(data, (SyntheticDataConfig, Hdf5DataConfig, UserDataConfig)):
        chosen = next(kind for kind, cls in DATA_SCHEMAS.items() if isinstance(data, cls))
        if data.kind != chosen:
            raise UserError(
                f"data.kind={data.kind} contradicts the data group chosen ({chosen}); choose the group"
                f" instead: data={data.kind}"
            )
        return data
    raw = dict(data)
    kind = raw.get("kind", DataKind.user.value if "_target_" in raw else None)
    if kind not in DataKind.values():
        raise UserError(f"data.kind={kind}: expected one of {', '.join(DataKind.values())}")
    if kind == DataKind.user:
        return user_data_config(raw)
    return typed(DATA_SCHEMAS[DataKind(kind)], raw, prefix="data.")


USER_DATA_KEYS = frozenset(f.name for f in dataclasses.fields(UserDataConfig))


def user_data_config(raw: dict[str, Any]) -> UserDataConfig:
    """A user's data section: the schema's keys, and every other key an argument of its
    function (in `kwargs`, where the plain form keeps them)."""
    rest = {k: v for k, v in raw.items() if k not in USER_DATA_KEYS and not k.startswith("_")}
    known = {k: v for k, v in raw.items() if k in USER_DATA_KEYS}
    known["kind"] = DataKind.user.value
    known["kwargs"] = {**dict(known.get("kwargs") or {}), **rest}
    return typed(UserDataConfig, known, prefix="data.")


def typed(cls: type, raw: Mapping[str, Any], *, prefix: str = "") -> Any:
    """`raw` checked against the schema `cls` and turned into it; mistakes are UserErrors."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), dict(raw)))
    except OmegaConfBaseException as exc:
        raise UserError(explain(exc, prefix=prefix)) from None


def model_to_dict(model: ModelConfig) -> dict[str, Any]:
    """The model section as its yaml spells it: `_target_`, the factory's keys, the parallel keys."""
    return plain({"_target_": model._target_, **model.kwargs, **{k: getattr(model, k) for k in PARALLEL_KEYS}})


def to_dict(cfg: Config) -> dict[str, Any]:
    """The plain form: JSON- and YAML-ready, the model flat."""
    out = plain(dataclasses.asdict(cfg))
    out["model"] = model_to_dict(cfg.model)
    return out


def from_dict(raw: Mapping[str, Any]) -> Config:
    """The typed config of a plain one (plan.json, config.yaml), checked by the schemas."""
    return finish(typed(Config, raw))


def plain(value: Any) -> Any:
    """Enums as their strings, containers copied: what json and yaml write as the user typed it."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


def explain(exc: Exception, *, prefix: str = "") -> str:
    """Turn a Hydra/OmegaConf exception into one line that names the key and what would work.
    `prefix` goes before the key (a section checked on its own: "model.")."""
    cause = exc.__cause__ or exc
    text = str(exc)
    ctext = str(cause)
    found = re.search(r"full_key: (\S+)", ctext)
    if found:
        key = f"{prefix}{found.group(1)}"
        m = re.search(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", ctext)
        if m:
            return f"{key}={m.group(1)}: expected {m.group(3).lower()}, got '{m.group(1)}'"
        m = re.search(r"Invalid value '(.*)', expected one of \[(.*)\]", ctext)
        if m:
            return f"{key}={m.group(1)}: expected one of {m.group(2)}"
        m = re.search(r"Key '([^']+)' not in '(\w+)'", ctext)
        if m:
            return f"unknown key '{key}' (not a field of {m.group(2)}); python -m dtk.plan --help lists every key"
        return f"{key}: {ctext.splitlines()[0]}"
    m = re.search(r"Could not find '(\w+)/([^']*)'", text)
    if m:
        group, name = m.groups()
        listing = text.split("Available options in", 1)[1].split("Config search path", 1)[0] if "Available options in" in text else ""
        options = [
            line.strip() for line in listing.splitlines()[1:] if line.strip() and not line.strip().endswith("_schema")
        ]
        hint = f"available: {', '.join(options)}" if options else f"no options in conf/{group}/"
        return f"{group}={name}: no such {group} ({hint})"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if text.startswith("Ambiguous value"):
        lines = lines[:3] + ["or put -m before the overrides to sweep over the values"]
    return "; ".join(lines[:4]) if lines else type(exc).__name__
