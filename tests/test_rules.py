"""The project's written rules, checked: one source for each default, ASCII for what users
read, `num_` for counts, modules of at most 400 lines, functions of at most 80. Each checker is also run on a planted
violation, so a checker that can no longer fail fails here."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from conftest import REPO
from dtk.config import schema

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def schema_defaults() -> dict[str, list]:
    """{field name: the literal defaults some schema gives it} over every schema dataclass."""
    out: dict[str, list] = {}
    for cls in [c for c in vars(schema).values() if dataclasses.is_dataclass(c)]:
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING and f.default is not None:
                value = f.default.value if hasattr(f.default, "value") else f.default
                out.setdefault(f.name, []).append(value)
    return out


def _literal(node: ast.AST):
    """The value of a literal expression; None for anything computed."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _neutral(value) -> bool:
    """None, False, 0, 1 (the degree that means "not split"), an empty string or container."""
    if isinstance(value, bool):
        return value is False
    return value is None or value in (0, 1, "") or value in ([], {}, ())


def config_default_violations(source: str, where: str) -> list[str]:
    """Where `source` restates a config default: `.get("key", default)` for a schema key (a
    config value read with a fallback of its own, the way defaults drift), or a parameter or
    dataclass field named like a schema key whose literal default is the schema's (unless
    it is a neutral value: None, False, 0, 1 (one of a degree), empty)."""
    fields = schema_defaults()
    names = {f.name for c in vars(schema).values() if dataclasses.is_dataclass(c) for f in dataclasses.fields(c)}
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in names
        ):
            found.append(f"{where}:{node.lineno}: .get({node.args[0].value!r}, default) restates a config default")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
            for arg, default in pairs:
                value = _literal(default)
                if arg.arg in fields and not _neutral(value) and value in fields[arg.arg]:
                    found.append(f"{where}:{node.lineno}: parameter {arg.arg}={value!r} restates a config default")
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            value = _literal(node.value)
            if node.target.id in fields and not _neutral(value) and value in fields[node.target.id]:
                found.append(f"{where}:{node.lineno}: {node.target.id} = {value!r} restates a config default")
    return found


def python_files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py"))


def test_no_config_default_is_restated_outside_the_schema():
    found = []
    for path in python_files("dtk", "benchmarks"):
        if path.is_relative_to(REPO / "dtk" / "config"):
            continue
        found += config_default_violations(path.read_text(), str(path.relative_to(REPO)))
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "planted",
    [
        'asynchronous = bool(cfg["checkpoint"].get("async_save", False))',  # the drift this rule was written for
        "split(dataset, val_fraction=data.get('val_fraction', 0.0))",
        "def build(*, vocab_size, seq_len: int = 64):\n    pass",
        "def loader(data, val_fraction=0.05):\n    pass",
        "def save(*, async_save=True):\n    pass",
        "class Saver:\n    async_save: bool = True",
    ],
)
def test_the_default_rule_catches_a_planted_restatement(planted):
    assert config_default_violations(planted, "planted.py")


def test_the_default_rule_lets_plain_code_through():
    clean = "x = cfg.checkpoint.async_save\nsummary.get('status')\ndef f(*, ahead=2):\n    pass"
    assert config_default_violations(clean, "clean.py") == []


def non_ascii_lines(text: str, where: str) -> list[str]:
    return [f"{where}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if not line.isascii()]


def test_what_users_read_is_ascii():
    """Messages, --help (the schema's doc strings), progress lines and the conf/ comments
    survive any terminal and log pipeline: x for times, -> for arrows, >= for at least."""
    paths = python_files("dtk", "benchmarks") + sorted((REPO / "conf").rglob("*.yaml"))
    found = [hit for p in paths for hit in non_ascii_lines(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))]
    assert not found, "\n".join(found[:20])
    assert non_ascii_lines('raise UserError(f"{a} \u00d7 {b}")', "planted.py")


COUNT_NAME = re.compile(r"\bn_[a-z]\w*")


def count_names(source: str, where: str) -> list[str]:
    """Identifiers (and string keys) named `n_*`: counts are `num_*`. Keyword arguments of
    calls are not checked: they are the callee's names (torch's `n_microbatches`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = COUNT_NAME.findall(node.value)
        found += [f"{where}:{getattr(node, 'lineno', '?')}: {n}" for n in names if COUNT_NAME.fullmatch(n)]
    return found


def test_counts_are_num_prefixed():
    found = [hit for p in python_files("dtk", "benchmarks") for hit in count_names(p.read_text(), str(p.relative_to(REPO)))]
    yaml_keys = [
        f"{p.relative_to(REPO)}: {m}" for p in (REPO / "conf").rglob("*.yaml") for m in COUNT_NAME.findall(p.read_text())
    ]
    assert not found + yaml_keys, "\n".join(found + yaml_keys)
    assert count_names("def f(n_layers):\n    return n_layers", "planted.py")


def test_no_module_is_over_400_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in python_files("dtk")}
    over = {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them): {over}"


def long_functions(source: str, where: str) -> list[str]:
    """Functions (methods and nested ones too) longer than MAX_FUNCTION_LINES, from `def` (its
    decorators not counted) to its last line."""
    return [f"{where}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno is not None
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_over_80_lines():
    found = [v for p in python_files("dtk") for v in long_functions(p.read_text(), str(p.relative_to(REPO)))]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (cut them at their seams): {found}"
    lines = [f"x{i} = {i}" for i in range(MAX_FUNCTION_LINES)]  # with its `def`: one line over

    def planted(indent: str, body: list[str]) -> str:
        return "".join(f"{indent}    {line}\n" for line in body)
    assert long_functions(f"async def f():\n{planted('', lines)}", "planted.py") == ["planted.py:1 f (81 lines)"]
    assert long_functions(f"class C:\n    def f(self):\n{planted('    ', lines)}", "planted.py")
    assert not long_functions(f"def f():\n{planted('', lines[:-1])}", "planted.py")  # 80 lines
