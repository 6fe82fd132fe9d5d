"""The package rules, checked: each package's `__init__.py` says which stages it may import
("May import config, plan and ..."), every import of its modules (parsed with `ast`, also
those inside functions and under TYPE_CHECKING) keeps to that, and no two packages depend on
each other, directly or around a loop. Each checker also runs on a planted violation."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from conftest import REPO

SHARED = frozenset({"common"})
"""The package every stage may import (dtk/common/); it imports no stage (checked below)."""
ANY_STAGE = "any stage"


def top_names(root: Path) -> set[str]:
    """dtk's top-level names: its packages and its top-level modules."""
    return {p.name for p in root.iterdir() if (p / "__init__.py").is_file()} | {
        p.stem for p in root.glob("*.py") if p.stem != "__init__"
    }


def owner(path: Path, root: Path) -> str:
    """The top-level name a file belongs to: dtk/plan/degrees.py -> plan, dtk/submit/__main__.py -> submit."""
    first = path.relative_to(root).parts[0]
    return first.removesuffix(".py")


@functools.cache  # each file is parsed once, however many graphs are drawn
def import_statements(source: str) -> tuple[tuple[str, tuple[str, ...], int], ...]:
    """(module, names, line) of every absolute import: `import a.b` -> ("", ("a.b",), line),
    `from a import b, c` -> ("a", ("b", "c"), line); inside functions too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.append(("", tuple(a.name for a in node.names), node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, tuple(a.name for a in node.names), node.lineno))
    return tuple(found)


def imported(source: str) -> list[tuple[str, int]]:
    """(second component of every dtk module imported, line): `from dtk.plan.plan import x`
    -> plan, `from dtk import audit` -> audit, `import dtk.config.schema` -> config."""
    found = []
    for module, names, line in import_statements(source):
        full = names if not module else [f"dtk.{n}" for n in names] if module == "dtk" else [module]
        found += [(n.split(".")[1], line) for n in full if n.startswith("dtk.")]
    return found


def import_graph(files: dict[str, str]) -> dict[str, dict[str, str]]:
    """{top-level name: {top-level name it imports: where (path:line, the first)}} of
    `files` ({path relative to the repository: source}); imports inside one name are left out."""
    graph: dict[str, dict[str, str]] = {}
    for path, source in sorted(files.items()):
        src = owner(Path(path), Path("dtk"))
        edges = graph.setdefault(src, {})
        for dst, line in imported(source):
            if dst != src:
                edges.setdefault(dst, f"{path}:{line}")
    return graph


def stated_rule(init_doc: str, names: set[str]) -> set[str] | None:
    """The names a package's doc string says it may import ("May import A, B (why) and C;"),
    or None when it states no rule. "any stage" allows every name."""
    start = init_doc.find("May import ")
    if start < 0:
        return None
    text = re.sub(r"\([^)]*\)", " ", init_doc[start + len("May import "):])  # a parenthesis says why
    text = re.split(r"[;:]|\.\s|\.$", text, maxsplit=1)[0]
    if ANY_STAGE in text:
        return set(names)
    return {m for m in re.findall(r"(?:dtk\.)?([a-z_]+)", text) if m in names}


def rules(root: Path) -> dict[str, set[str]]:
    names = top_names(root)
    out = {}
    for init in sorted(root.glob("*/__init__.py")):
        rule = stated_rule(ast.get_docstring(ast.parse(init.read_text())) or "", names)
        if rule is not None:
            out[init.parent.name] = rule
    return out


def layer_violations(graph: dict[str, dict[str, str]], allowed: dict[str, set[str]]) -> list[str]:
    """Imports a package's rule does not allow (the shared modules are always allowed), and
    shared modules that import a stage."""
    found = []
    for src, edges in sorted(graph.items()):
        if src in SHARED:
            found += [f"{where}: dtk.{src} is shared and imports dtk.{dst}" for dst, where in edges.items()
                      if dst not in SHARED]
        elif src in allowed:
            found += [f"{where}: dtk.{src} imports dtk.{dst}; its __init__.py allows {sorted(allowed[src])}"
                      for dst, where in sorted(edges.items()) if dst not in allowed[src] | SHARED]
    return found


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Every set of top-level names that import each other around a loop (strongly
    connected components of more than one name), each with its edges' locations."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                members = set(component)
                out.append(sorted(f"{s} -> {d} ({where})" for s in members
                                  for d, where in graph.get(s, {}).items() if d in members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@functools.lru_cache(maxsize=1)
def _read_dtk() -> tuple[tuple[str, str], ...]:
    return tuple((str(p.relative_to(REPO)), p.read_text()) for p in sorted((REPO / "dtk").rglob("*.py")))


def module_graph(files: dict[str, str]) -> dict[str, dict[str, str]]:
    """{module: {dtk module it imports: where}}: `from dtk.config import compose` names the
    module dtk.config.compose, `from dtk.config.compose import x` too."""
    def name(path: str) -> str:
        parts = list(Path(path).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p) for p in files}
    graph: dict[str, dict[str, str]] = {}
    for path, source in sorted(files.items()):
        src, edges = name(path), graph.setdefault(name(path), {})
        for module, names, line in import_statements(source):
            if not module:
                targets = list(names)
            else:
                targets = [f"{module}.{n}" if f"{module}.{n}" in modules else module for n in names]
            for t in targets:
                if t in modules and t != src and not src.startswith(t + "."):  # a package's own __init__
                    edges.setdefault(t, f"{path}:{line}")
    return graph


def dtk_files() -> dict[str, str]:
    """{path: source} of every module of dtk (a fresh dict: a test may plant into it)."""
    return dict(_read_dtk())


def test_every_stage_states_its_rule():
    """A package without a "May import" sentence would escape the check."""
    stated = rules(REPO / "dtk")
    packages = {p.parent.name for p in (REPO / "dtk").glob("*/__init__.py")}
    assert packages - set(stated) == set(), "packages whose __init__.py states no 'May import ...' rule"


def test_imports_keep_to_the_stated_rules():
    found = layer_violations(import_graph(dtk_files()), rules(REPO / "dtk"))
    assert not found, "\n".join(found)


def test_no_two_packages_import_each_other():
    found = cycles(import_graph(dtk_files()))
    assert not found, "\n".join("cycle: " + "; ".join(c) for c in found)


def test_no_two_modules_import_each_other():
    found = cycles(module_graph(dtk_files()))
    assert not found, "\n".join("cycle: " + "; ".join(c) for c in found)


def test_the_rule_is_read_from_the_doc_string():
    names = {"config", "plan", "launch", "worker", "rundir", "dist"}
    doc = "driver: ...\nMay import plan, launch (slurmctl), worker's tables (env, codes) and dtk.common.rundir; no torch."
    assert stated_rule(doc, names) == {"plan", "launch", "worker", "rundir"}
    assert stated_rule("worker: May import any stage (main.py wires them).", names) == names
    assert stated_rule("no rule here", names) is None


@pytest.mark.parametrize(
    "planted",
    [
        {"dtk/config/compose.py": "def f():\n    from dtk.plan.plan import make_plan\n"},  # inside a function
        {"dtk/data/hdf5.py": "from dtk.train import trainer\n"},
        {"dtk/report/runs.py": "import dtk.train.system\n"},
        {"dtk/plan/degrees.py": "from dtk import submit\n"},  # a command, from a stage
        {"dtk/common/rundir.py": "from dtk.plan.plan import Plan\n"},  # a shared module importing a stage
    ],
)
def test_the_layer_rule_catches_a_planted_import(planted):
    files = dtk_files() | {path: dtk_files()[path] + src for path, src in planted.items()}
    found = layer_violations(import_graph(files), rules(REPO / "dtk"))
    assert [v for v in found if v.split(":")[0] in planted], found


def test_the_cycle_check_catches_a_planted_loop():
    files = dtk_files()
    files["dtk/launch/sbatch.py"] += "from dtk.driver.supervisor import drive\n"  # driver imports launch
    found = cycles(import_graph(files))
    assert any("launch -> driver" in " ".join(c) for c in found), found
    longer = dtk_files()
    longer["dtk/config/schema.py"] += "from dtk.train.loss import Loss\n"  # train -> ... -> config -> train
    assert cycles(import_graph(longer))
    inside = dtk_files()
    inside["dtk/config/convert.py"] += "def f():\n    from dtk.config.compose import compose\n"  # the old pair
    assert any("dtk.config.convert -> dtk.config.compose" in " ".join(c) for c in cycles(module_graph(inside)))
