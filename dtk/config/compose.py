"""Compose a job's configuration from ``conf/`` and command-line overrides.

This and the command-line entry points are the only places that touch Hydra/OmegaConf.
Everything after composition works on the schema dataclasses (``Config``), typed to the
last consumer: each stage is handed the slice it needs (``cfg.optim``, ``cfg.scheme``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import hashlib
import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.common.resources import conf_dir
from dtk.config.convert import explain
from dtk.config.schema import Config

CONFIG_NAME = "config"
CONFIG_PATH_ENV = "DTK_CONFIG_PATH"
CONFIG_DIR_FLAG = "--config-dir"


def add_config_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(CONFIG_DIR_FLAG, dest="config_dirs", action="append", default=[], metavar="DIR",
                        help="a project folder (python -m dtk.init DIR) whose config groups and modules come first;"
                             " repeatable")


def config_dir() -> Path:
    """dtk's own config groups: `$DTK_CONFIG_DIR` (a replacement for all of them), else the
    package's `conf/`."""
    env = os.environ.get("DTK_CONFIG_DIR")
    path = Path(env) if env else conf_dir()
    if not (path / f"{CONFIG_NAME}.yaml").is_file():
        raise UserError(f"no {CONFIG_NAME}.yaml in config folder {path}; set DTK_CONFIG_DIR to dtk's conf/ folder")
    return path


@dataclass(frozen=True)
class SearchPath:
    """Where a job's config groups and code come from: the user's project folders, searched
    before dtk's own `conf/` (the first folder holding `GROUP/NAME.yaml` wins), and the same
    folders put on the import path of the submitting process and of every worker."""

    config: tuple[Path, ...] = ()
    """The user's config folders (each holds group folders: cluster/, model/, data/, task/ ...)."""
    modules: tuple[Path, ...] = ()
    """Project folders whose Python modules a config may name (`_target_: mymodel.build`)."""

    def activate(self) -> None:
        """Put the project folders first on this process's import path."""
        for folder in reversed(self.modules):
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))


def pop_config_dirs(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split `--config-dir DIR` / `--config-dir=DIR` (repeatable) off a command line."""
    dirs, rest = [], []
    args = iter(argv)
    for arg in args:
        if arg == CONFIG_DIR_FLAG:
            value = next(args, None)
            if value is None or value.startswith("-"):
                raise UserError(f"{CONFIG_DIR_FLAG} needs a folder: {CONFIG_DIR_FLAG} DIR (a project folder made by python -m dtk.init)")
            dirs.append(value)
        elif arg.startswith(f"{CONFIG_DIR_FLAG}="):
            dirs.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return dirs, rest


def _project(path: Path, source: str) -> tuple[Path, Path]:
    """(config folder, module folder) of a project folder or of its conf/ folder."""
    path = path.expanduser().resolve()
    if not path.is_dir():
        raise UserError(f"{source}: no such folder {path}; give a project folder (python -m dtk.init DIR makes one)")
    if (path / "conf").is_dir():
        return path / "conf", path
    if path.name == "conf":
        return path, path.parent
    return path, path


def search_path(config_dirs: list[str] | tuple[str, ...] = (), *, cwd: str | Path | None = None) -> SearchPath:
    """The user's folders, first match first: each `--config-dir`, then each entry of
    `$DTK_CONFIG_PATH` (separated by `:`), then the current folder when it has a `conf/` of
    its own (a project folder made by `python -m dtk.init`)."""
    found: list[tuple[Path, Path]] = [_project(Path(d), f"{CONFIG_DIR_FLAG} {d}") for d in config_dirs]
    for entry in filter(None, os.environ.get(CONFIG_PATH_ENV, "").split(os.pathsep)):
        found.append(_project(Path(entry), f"{CONFIG_PATH_ENV}={entry}"))
    here = Path(cwd or Path.cwd()).resolve()
    own = conf_dir().resolve()
    if (here / "conf").is_dir() and (here / "conf").resolve() != own:
        found.append((here / "conf", here))
    config, modules = [], []
    for conf, module in found:
        if conf.resolve() != own and conf not in config:
            config.append(conf)
        if module not in modules:
            modules.append(module)
    return SearchPath(config=tuple(config), modules=tuple(modules))


@contextlib.contextmanager
def _hydra(search: SearchPath) -> Iterator[None]:
    """Hydra initialised with the user's config folders before dtk's own. (Hydra's public
    `initialize_config_dir` takes one folder, and `hydra.searchpath` entries come after it,
    so a user's model/transformer.yaml could never replace dtk's.)"""
    from hydra import version
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    version.setbase(None)
    csp = create_config_search_path(search_path_dir=str(config_dir()))
    for folder in reversed(search.config):
        csp.prepend(provider="dtk-user", path=f"file://{folder}")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    Hydra.create_main_hydra2(task_name="dtk", config_search_path=csp)
    try:
        yield
    finally:
        GlobalHydra.instance().clear()


def compose(overrides: list[str], *, search: SearchPath | None = None) -> Config:
    """Compose, resolve and type the configuration; user mistakes raise UserError with one line.
    `search` defaults to `search_path()`: the environment's and the current folder's."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from dtk.config.convert import finish
    from dtk.config.schema import register

    register()
    try:
        with _hydra(search if search is not None else search_path()):
            cfg = _composed(list(overrides), search if search is not None else search_path())
        _reject_unknown_keys(cfg)
        typed = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        raise UserError(explain(exc)) from None
    except ValueError as exc:  # Hydra's own check of a group's value, e.g. `cluster=1`
        raise UserError(_bad_group_value(overrides, search or search_path(), exc)) from None
    except AssertionError:  # Hydra's, on a key under a group that was not chosen (`scheme.tp=2` alone)
        raise UserError(_unchosen_group(overrides, search or search_path())) from None
    assert isinstance(typed, Config)
    return finish(typed)


# Composed group choices (before value overrides), newest last; see _composed.
_BASES: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_BASES_KEPT = 32


def _composed(overrides: list[str], search: SearchPath) -> Any:
    """Hydra's compose of `overrides` (inside `_hydra`), with the defaults tree built once per
    distinct set of group choices in a process: a sweep's points, a handover's retries and a
    test suite mostly differ in values only, and the tree is most of a compose's time.

    Hydra composes in two steps: the group overrides (`model=hf`, `+scheme=fsdp`, and any
    `hydra.` key, which may move the search path) choose and merge the config files, then it
    applies the value overrides (`train.steps=5`, `+extra.x=1`, `~key`) to the result. The
    first step is kept, keyed by those overrides, the config folders and the bytes of every
    file in them (an edited yaml composes afresh); the second is Hydra's own code, run on a
    copy of it each time, so the result and the errors are Hydra's."""
    from hydra import compose as hydra_compose
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    parsed = OverridesParser.create().parse_overrides(overrides)
    hydra = GlobalHydra.instance().hydra
    assert hydra is not None, "_hydra() initialised it"
    repo = hydra.config_loader.repository  # type: ignore[attr-defined]

    def chooses(ov: Any) -> bool:  # as hydra's defaults_list.Overrides sorts them
        key = ov.key_or_group
        return (key == "hydra" or key.startswith(("hydra.", "hydra/")) or ov.is_sweep_override()
                or (not isinstance(ov.value(), dict) and repo.group_exists(key)))

    groups = [str(ov.input_line) for ov in parsed if chooses(ov)]
    values = [ov for ov in parsed if not chooses(ov)]
    # `hydra.searchpath=[file://DIR]` adds folders as well: their files are part of the key too.
    listed = [ov.value() for ov in parsed if ov.key_or_group == "hydra.searchpath"]
    named = [Path(str(p).removeprefix("file://")) for given in listed if isinstance(given, list)
             for p in given if str(p).startswith(("file://", "/"))]
    key = (tuple(groups), str(config_dir()), search.config, _fingerprint((config_dir(), *search.config, *named)))
    if key not in _BASES:
        _BASES[key] = hydra_compose(CONFIG_NAME, overrides=groups)
        while len(_BASES) > _BASES_KEPT:
            _BASES.popitem(last=False)
    _BASES.move_to_end(key)
    cfg = copy.deepcopy(_BASES[key])
    ConfigLoaderImpl.validate_sweep_overrides_legal(values, run_mode=RunMode.RUN, from_shell=False)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except OmegaConfBaseException as exc:  # as Hydra's load_configuration wraps it
        raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from exc
    return cfg


def _fingerprint(folders: tuple[Path, ...]) -> tuple:
    """Every file under the config folders, with a digest of its bytes."""
    found = []
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for name in sorted(files):
                path = Path(root, name)
                with contextlib.suppress(OSError):
                    found.append((str(path), hashlib.sha1(path.read_bytes()).hexdigest()))
    return tuple(found)


def _bad_group_value(overrides: list[str], search: SearchPath, exc: ValueError) -> str:
    """`cluster=1: cluster is a config group; choose one of: lab, local, slurm`."""
    folders = (config_dir(), *search.config)
    for text in overrides:
        key, _, value = text.lstrip("+~").partition("=")
        options = sorted({p.stem for f in folders for p in (f / key).glob("*.yaml")} if key else ())
        if options and value not in options:
            return f"{key}={value}: {key} is a config group; choose one of: {', '.join(options)}"
    return " ".join(str(exc).split())


def _unchosen_group(overrides: list[str], search: SearchPath) -> str:
    """`scheme.tp=2: scheme.* keys need a scheme; add +scheme=NAME (one of: ddp, fsdp, ...)`."""
    folders = (config_dir(), *search.config)
    # scheme is the group the defaults leave out (+scheme=NAME adds it): its keys first
    for text in sorted(overrides, key=lambda o: not o.lstrip("+~").startswith("scheme.")):
        key = text.lstrip("+~").partition("=")[0]
        group = key.partition(".")[0]
        options = sorted({p.stem for f in folders for p in (f / group).glob("*.yaml")})
        if "." in key and options:
            named = key.partition(".")[2]  # scheme.tp -> the tp scheme, when there is one
            example = named if named in options else options[0]
            return (f"{text}: {group}.* keys need a {group} chosen first; add +{group}=NAME before them"
                    f" (one of: {', '.join(options)}), e.g. +{group}={example} {text.lstrip('+')}")
    return f"overrides {' '.join(overrides)} do not compose (a key under a config group that was not chosen?)"


def _reject_unknown_keys(node: Any, path: str = "") -> None:
    """`+key=value` bypasses struct mode; a key no schema declares is a typo, not a wish."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        known = {f.name for f in dataclasses.fields(schema)}
        for key in map(str, node.keys()):
            if key not in known:
                full = f"{path}{key}"
                raise UserError(
                    f"unknown key '{full}'; known keys here: {', '.join(sorted(known))} "
                    "(python -m dtk.plan --help lists every key)"
                )
    if path == "extra.":
        return  # free-form by design
    for key in map(str, node.keys()):
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _reject_unknown_keys(child, f"{path}{key}.")


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Expand Hydra sweep syntax (`optim.lr=1e-3,3e-4`, `range(...)`, `choice(...)`) into the
    cartesian product of single-job override lists, in command-line order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise UserError(explain(exc)) from None
    axes = []
    for ov in parsed:
        if ov.is_sweep_override():
            key = ov.get_key_element()
            axes.append([f"{key}={value}" for value in ov.sweep_string_iterator()])
        else:
            assert ov.input_line is not None, "the parser keeps each override's text"
            axes.append([ov.input_line])
    return [list(point) for point in itertools.product(*axes)]


def to_yaml(cfg: Config) -> str:
    """config.yaml: the resolved configuration as the user would write it."""
    from dtk.config.convert import to_yaml as plain_yaml

    return plain_yaml(cfg)
