"""Compose a job's configuration from ``conf/`` and command-line overrides.

This and the command-line entry points are the only places that touch Hydra/OmegaConf.
Everything after composition works on a plain, resolved ``dict``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from pathlib import Path
from typing import Any

from dtk.errors import UserError

CONFIG_NAME = "config"


def config_dir() -> Path:
    """The `conf/` folder: `$DTK_CONFIG_DIR`, else the one beside the `dtk` package."""
    env = os.environ.get("DTK_CONFIG_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "conf"
    if not (path / f"{CONFIG_NAME}.yaml").is_file():
        raise UserError(f"no {CONFIG_NAME}.yaml in config folder {path}; set DTK_CONFIG_DIR to dtk's conf/ folder")
    return path


def compose(overrides: list[str]) -> dict[str, Any]:
    """Compose and resolve the configuration; user mistakes raise UserError with one line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from dtk.config.schema import register

    register()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = hydra_compose(CONFIG_NAME, overrides=list(overrides))
        _reject_unknown_keys(cfg)
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (HydraException, OmegaConfBaseException) as exc:
        raise UserError(_explain(exc)) from None
    assert isinstance(resolved, dict)
    return resolved


def _reject_unknown_keys(node: Any, path: str = "") -> None:
    """`+key=value` bypasses struct mode; a key no schema declares is a typo, not a wish."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        known = {f.name for f in dataclasses.fields(schema)}
        for key in node.keys():
            if key not in known:
                full = f"{path}{key}"
                raise UserError(
                    f"unknown key '{full}'; known keys here: {', '.join(sorted(known))} "
                    "(python -m dtk.plan --help lists every key)"
                )
    if path == "extra.":
        return  # free-form by design
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _reject_unknown_keys(child, f"{path}{key}.")


def _explain(exc: Exception) -> str:
    """Turn a Hydra/OmegaConf exception into one line that names the key and what would work."""
    cause = exc.__cause__
    text = str(exc)
    if cause is not None:
        ctext = str(cause)
        key = re.search(r"full_key: (\S+)", ctext)
        m = re.search(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", ctext)
        if key and m:
            return f"{key.group(1)}={m.group(1)}: expected {m.group(3).lower()}, got '{m.group(1)}'"
        m = re.search(r"Key '([^']+)' not in '(\w+)'", ctext)
        if m and key:
            return (
                f"unknown key '{key.group(1)}' (not a field of {m.group(2)}); "
                "python -m dtk.plan --help lists every key"
            )
        if key:
            return f"{key.group(1)}: {ctext.splitlines()[0]}"
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


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Expand Hydra sweep syntax (`optim.lr=1e-3,3e-4`, `range(...)`, `choice(...)`) into the
    cartesian product of single-job override lists, in command-line order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise UserError(_explain(exc)) from None
    axes = []
    for ov in parsed:
        if ov.is_sweep_override():
            key = ov.get_key_element()
            axes.append([f"{key}={value}" for value in ov.sweep_string_iterator()])
        else:
            axes.append([ov.input_line])
    return [list(point) for point in itertools.product(*axes)]


def to_yaml(cfg: dict[str, Any]) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(cfg))
