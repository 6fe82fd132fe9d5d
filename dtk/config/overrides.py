"""The command-line overrides that compose a given resolved config: how a handed-over run
is repeated by someone else (`python -m dtk.handover`).

The overrides are the group choices (`data=hdf5`, `+scheme=fsdp`) and every key whose
value differs from what those choices compose to; they are accepted only once composing
them gives the same identity hash, so the command they make is the same run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.config.compose import SearchPath
from dtk.config.convert import to_dict
from dtk.config.schema import Config

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
    """The group options of a config in its plain form (dtk.config.convert.to_dict) that its
    values name: the data kind, the scheme, the sync mode, the access policy."""
    choices = []
    if cfg["data"]["kind"] != "synthetic":
        choices.append(f"data={cfg['data']['kind']}")
    if cfg["scheme"] is not None:
        choices.append(f"+scheme={cfg['scheme']['name']}")
    if cfg.get("sync") is not None:  # +sync=local_sgd|diloco (runs from before it have no sync)
        choices.append(f"+sync={cfg['sync']['mode']}")
    if "access" in cfg and cfg["access"]["name"] != "open":  # runs from before access policies have none
        choices.append(f"access={cfg['access']['name']}")
    return choices


# Groups whose option a config does not name: found by the factory (`_target_`) it composes to.
_BY_TARGET = ("model", "task")


def _options(group: str, search: SearchPath) -> list[str]:
    from dtk.config.compose import config_dir

    folders = (*search.config, config_dir())
    return sorted({p.stem for f in folders for p in (Path(f) / group).glob("*.yaml")})


def _target_choices(plain: dict[str, Any], choices: list[str], search: SearchPath) -> tuple[list[str], dict[str, Any]]:
    """(choices with `model=NAME`, `task=NAME` added where the search path's default (a
    project's conf/project/default.yaml included) composes another factory than the run's,
    the plain config those choices compose)."""
    from dtk.config.compose import compose

    found = _data_choice(plain, choices, search)
    composed = to_dict(compose(found, search=search))
    for group in _BY_TARGET:
        wanted = plain[group].get("_target_")
        if composed[group].get("_target_") == wanted:
            continue
        for option in _options(group, search):
            tried = to_dict(compose([*found, f"{group}={option}"], search=search))
            if tried[group].get("_target_") == wanted:
                found, composed = [*found, f"{group}={option}"], tried
                break
    return found, composed


def _data_choice(plain: dict[str, Any], choices: list[str], search: SearchPath) -> list[str]:
    """The data choice with what it needs to compose: `data=hdf5` its `data.path`; a dataset
    of the user's own: `data=user` names no function (it composes none), so the
    choice is the option of the data group (a project's conf/data/NAME.yaml) whose function
    is the run's, else `data=user` with the function as an override."""
    from dtk.config.compose import compose

    if plain["data"]["kind"] == "hdf5":  # data=hdf5 composes only with its folder
        return [*choices, f"data.path={value_text(plain['data']['path'])}"]
    if plain["data"]["kind"] != "user":
        return list(choices)
    others = [c for c in choices if not c.startswith("data=")]
    wanted = plain["data"].get("_target_")
    for option in _options("data", search):
        try:
            tried = to_dict(compose([*others, f"data={option}"], search=search))
        except UserError:
            continue
        if tried["data"]["kind"] == "user" and tried["data"].get("_target_") == wanted:
            return [*others, f"data={option}"]
    return [*others, "data=user", f"data._target_={value_text(wanted)}"]


def repeat_overrides(cfg: Config, config_hash: str, *,
                     search: SearchPath | None = None) -> tuple[list[str] | None, str]:
    """(overrides, "") that compose a config of the same hash with the config folders of
    `search` (default: dtk's own alone), or (None, why not). The hash is the run identity's
    (dtk.config.identity), or v0.1.0's for a run that release named (dtk.config.identity_v0)."""
    from dtk.config.compose import compose
    from dtk.config.identity import identity_hash
    from dtk.config.identity_v0 import v0_hash

    search = search if search is not None else SearchPath()
    plain = to_dict(cfg)
    try:
        choices, composed = _target_choices(plain, group_choices(plain), search)
        base = flatten(composed)
    except (UserError, KeyError) as exc:
        return None, f"the run's config groups are not among this dtk's ({exc})"
    wanted = flatten(plain)
    overrides = choices + [f"{'' if key in base else '+'}{key}={value_text(value)}" for key, value in wanted.items()
                           if key not in LEFT_OUT and base.get(key, object()) != value]
    overrides += [f"~{key}" for key in base if key not in wanted and key not in LEFT_OUT and _removable(key)]
    try:
        composed_again = compose(overrides, search=search)
    except UserError as exc:
        return None, f"the overrides derived from config.yaml do not compose ({exc}); start from config/config.yaml"
    again = identity_hash(composed_again)
    if config_hash not in (again, v0_hash(composed_again)):  # a run named by v0.1.0 keeps its hash
        return None, (f"the overrides derived from config.yaml compose config hash {again}, not the run's"
                      f" {config_hash}; start from config/config.yaml")
    return overrides, ""


def _removable(key: str) -> bool:
    """A key of a free-form section (a user model's yaml) that the run did not have."""
    return key.split(".")[0] in _BY_TARGET and key.count(".") == 1 and not key.endswith("_target_")
