"""Every configuration key with its type, default and doc string, read from the schemas.

Python keeps no attribute doc strings, so they are read from the source. Which schema a
config group uses comes from the ConfigStore registrations (`schema.register`), so a new
field or a new registered schema shows up here, in `python -m dtk.plan --help` and in
docs/reference.md (`python -m dtk.config.reference`) without anyone listing it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any

IDENTITY_MARK = "[identity]"
"""Before the doc of a key that is part of what a run computes (dtk/config/identity.py)."""


@dataclass(frozen=True)
class Key:
    key: str
    """Dotted key as typed on the command line (`data.path`)."""
    type: str
    default: str
    doc: str


@dataclass(frozen=True)
class Section:
    """The keys of one schema: the root's own, a nested section, or one option of a group."""

    prefix: str
    """`""` for the top level, else the section's dotted name (`data`)."""
    option: str | None
    """For a config group, the option that selects this schema (`hdf5` for `data=hdf5`)."""
    doc: str
    keys: tuple[Key, ...]


def field_docs(cls: type) -> dict[str, str]:
    """{field name: the string literal right under it} for one dataclass and its bases."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def group_schemas() -> dict[str, dict[str, type]]:
    """{group: {option: schema class}} from the ConfigStore, options sorted by name, for
    the groups that are keys of the root config (Hydra registers its own `hydra` group).
    An option is the registered name without its `_schema` suffix."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from dtk.config.schema import Config, register

    register()
    root_keys = {f.name for f in dataclasses.fields(Config)}
    groups: dict[str, dict[str, type]] = {}
    for group, entries in ConfigStore.instance().repo.items():
        if group not in root_keys or not isinstance(entries, dict):
            continue
        for filename, node in entries.items():
            cls = OmegaConf.get_type(node.node)
            if cls is not None and dataclasses.is_dataclass(cls):
                option = filename.removesuffix(".yaml").removesuffix("_schema")
                groups.setdefault(group, {})[option] = cls
    return {g: dict(sorted(options.items())) for g, options in groups.items()}


def sections() -> list[Section]:
    """The root config's keys, then each nested section and group option, in field order."""
    from dtk.config.schema import Config

    groups = group_schemas()
    out: list[Section] = []

    def walk(cls: type, prefix: str, option: str | None, doc: str) -> None:
        docs = field_docs(cls)
        try:
            hints = typing.get_type_hints(cls)
        except (NameError, TypeError):  # an annotation that names something not importable here
            hints = {}
        keys: list[Key] = []
        nested: list[tuple[str, str | None, type, str]] = []
        for f in dataclasses.fields(cls):
            name = f"{prefix}.{f.name}" if prefix else f.name
            options = groups.get(name, {}) if not prefix else {}
            factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if options:
                shown = options if len(options) > 1 else {None: next(iter(options.values()))}
                nested += [(name, opt, sub, docs.get(f.name, "")) for opt, sub in shown.items()]
            elif factory is not None and dataclasses.is_dataclass(factory):
                nested.append((name, None, factory, docs.get(f.name, "")))
            else:
                text = docs.get(f.name, "")
                text = f"{IDENTITY_MARK} {text}" if f.metadata.get("identity") else text
                keys.append(Key(name, type_name(f.type, hints.get(f.name)), default(f), text))
        out.append(Section(prefix, option, doc, tuple(keys)))
        for name, opt, sub, sub_doc in nested:
            class_doc = " ".join((sub.__doc__ or "").split()) if "__doc__" in vars(sub) else ""
            if class_doc.startswith(f"{sub.__name__}("):  # the dataclass-generated signature
                class_doc = ""
            walk(sub, name, opt, " ".join(part for part in (sub_doc, class_doc) if part))

    walk(Config, "", None, "")
    return out


def type_name(annotation: Any, hint: Any = None) -> str:
    """The annotation as written (`int | None`): a string under `from __future__ import
    annotations`, else the type's name; an Enum's allowed values follow in parentheses."""
    if isinstance(annotation, str):
        text = annotation
    elif isinstance(annotation, type):
        text = annotation.__name__
    else:
        text = str(annotation).replace("typing.", "")
    unions = (typing.Union, types.UnionType) if hasattr(types, "UnionType") else (typing.Union,)
    candidates = typing.get_args(hint) if typing.get_origin(hint) in unions else (hint,)
    enums = [c for c in candidates if isinstance(c, type) and issubclass(c, Enum)]
    if enums:
        text += " (" + ", ".join(str(m.value) for m in enums[0]) + ")"
    return text


def default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default.value if isinstance(f.default, Enum) else f.default
        if value == "???":  # omegaconf.MISSING: the key must be given
            return "required"
        return repr(value) if isinstance(value, str) else str(value)
    if f.default_factory is not dataclasses.MISSING:
        return str(f.default_factory())
    return "required"


def key_table() -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every key of every section."""
    return [(k.key, k.default, k.doc) for s in sections() for k in s.keys]


def render_keys() -> str:
    """The key list `python -m dtk.plan --help` prints: one line per key, a heading line
    before the keys of each option of a group with several."""
    found = sections()
    width = max(len(k.key) for s in found for k in s.keys)
    lines: list[str] = []
    for s in found:
        if s.option is not None and s.keys:
            lines.append(f"  [{s.prefix}={s.option}]")
        lines += [f"  {k.key:<{width}}  {k.default:<10}  {k.doc}" for k in s.keys]
    return "\n".join(lines)
