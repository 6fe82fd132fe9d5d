"""The handover documents stay true: every `python -m dtk...` line in their code blocks names
a command that exists, and each plan or submit line without placeholders composes and
plans (a submit line as a dry run). Fast: nothing is trained."""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

from conftest import REPO, run_main

DOCS = ("operations.md", "acceptance.md", "recovery.md", "access.md")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]{2,}\b|<[^>]+>|\$")


def code_lines(text: str) -> list[str]:
    """Lines of indented (4 spaces) and fenced code blocks, comments cut off."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            code = line.strip().removeprefix("$ ")
            lines.append(code.split("  #", 1)[0].strip())
    return [ln for ln in lines if ln]


def dtk_commands(name: str) -> list[list[str]]:
    commands = []
    for line in code_lines((REPO / "docs" / name).read_text()):
        m = re.search(r"python -m (dtk[\w.]*)(.*)", line)
        if m:
            commands.append([m.group(1), *shlex.split(m.group(2))])
    return commands


@pytest.mark.parametrize("name", DOCS)
def test_every_command_in_the_document_exists(name):
    commands = dtk_commands(name)
    assert commands, f"docs/{name} shows no dtk command"
    for module, *_ in commands:
        assert importlib.util.find_spec(module) is not None, f"docs/{name}: python -m {module}: no such module"


@pytest.mark.parametrize("name", DOCS)
def test_plan_and_submit_lines_compose_and_plan(name, tmp_path):
    checked = 0
    for module, *args in dtk_commands(name):
        if module not in ("dtk.plan", "dtk.submit") or any(PLACEHOLDER.search(a) for a in args):
            continue
        argv = [*args, f"run.root={tmp_path / 'runs'}"] + (["submit.dry_run=true"] if module == "dtk.submit" else [])
        proc = run_main(module, *argv, cwd=tmp_path)
        assert proc.returncode == 0, f"docs/{name}: python -m {module} {' '.join(args)}: {proc.stderr}"
        checked += 1
    assert not (tmp_path / "runs").exists()  # plans and dry runs create nothing
