"""Field doc strings of the schemas, read from the source (Python keeps no attribute doc strings)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from typing import Any

from dtk.config import schema


def field_docs(cls: type) -> dict[str, str]:
    """{field name: the string literal right under it} for one dataclass."""
    tree = ast.parse(inspect.getsource(cls))
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


# Sections whose schema is chosen by a config group; the built-in option documents them.
GROUP_SCHEMAS: dict[str, type] = {
    "cluster": schema.ClusterConfig,
    "model": schema.TransformerConfig,
    "data": schema.SyntheticDataConfig,
    "scheme": schema.SchemeConfig,
}


def key_table() -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every key of the root config."""
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            name = f"{prefix}{f.name}"
            sub = GROUP_SCHEMAS.get(name) if not prefix else None
            nested = sub or (f.default_factory if dataclasses.is_dataclass(f.default_factory) else None)
            if nested is not None and dataclasses.is_dataclass(nested):
                walk(nested, f"{name}.")
                continue
            rows.append((name, _default(f), docs.get(f.name, "")))

    walk(schema.Config, "")
    return rows


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default) if isinstance(f.default, str) else str(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value: Any = f.default_factory()  # type: ignore[misc]
        return str(value)
    return "???"


def render_keys() -> str:
    rows = key_table()
    width = max(len(k) for k, _, _ in rows)
    return "\n".join(f"  {k:<{width}}  {d:<10}  {doc}" for k, d, doc in rows)
