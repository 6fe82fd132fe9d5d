"""The command-line overrides that compose a given resolved config: how a handed-over run
is repeated by someone else (`python -m dtk.handover`).

The overrides are the group choices (`data=hdf5`, `+scheme=fsdp`) and every key whose
value differs from what those choices compose to; they are accepted only once composing
them gives the same semantic hash, so the command they make is the same run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dtk.config.convert import to_dict
from dtk.config.schema import Config
from dtk.errors import UserError

# Where a handed-over run lives is the receiving team's choice.
LEFT_OUT = ("run.root",)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node and prefix not in ("extra.", "model.tp_plan."):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def value_text(value: Any) -> str:
    """A value as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return "'" + json.dumps(value, separators=(",", ":")) + "'"
    text = str(value)
    return text if text and all(c.isalnum() or c in "._-/:" for c in text) else json.dumps(text)


def group_choices(cfg: dict[str, Any]) -> list[str]:
    """The group options of a config in its plain form (dtk.config.convert.to_dict)."""
    choices = []
    if cfg["data"]["kind"] != "synthetic":
        choices.append(f"data={cfg['data']['kind']}")
    if cfg["scheme"] is not None:
        choices.append(f"+scheme={cfg['scheme']['name']}")
    if "access" in cfg and cfg["access"]["name"] != "open":  # runs from before access policies have none
        choices.append(f"access={cfg['access']['name']}")
    return choices


def repeat_overrides(cfg: Config, config_hash: str, *, semantic_hash: Callable[[Config], str]
                     ) -> tuple[list[str] | None, str]:
    """(overrides, "") that compose a config of the same hash, or (None, why not). The hash
    is the run identity's (dtk.plan.plan.semantic_hash), handed in: config is the first stage."""
    from dtk.config.compose import compose

    plain = to_dict(cfg)
    try:
        choices = group_choices(plain)
        base = flatten(to_dict(compose(choices)))
    except (UserError, KeyError) as exc:
        return None, f"the run's config groups are not among this dtk's ({exc})"
    wanted = flatten(plain)
    overrides = choices + [f"{key}={value_text(value)}" for key, value in wanted.items()
                           if key not in LEFT_OUT and base.get(key, object()) != value]
    try:
        again = semantic_hash(compose(overrides))
    except UserError as exc:
        return None, f"the overrides derived from config.yaml do not compose ({exc}); start from config/config.yaml"
    if again != config_hash:
        return None, (f"the overrides derived from config.yaml compose config hash {again}, not the run's"
                      f" {config_hash}; start from config/config.yaml")
    return overrides, ""
