"""The handover documents stay true: every `python -m dtk...` line in their code blocks names
a command that exists, and each plan or submit line without placeholders composes and
plans (a submit line as a dry run). Every `$ ` example of README.md and docs/*.md runs as
typed and prints the lines shown under it. Fast: nothing is trained."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

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


def dollar_examples() -> list[tuple[str, str, list[str]]]:
    """(document, command, the lines printed under it) of every `$ ` example in a code block."""
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.lstrip().startswith("$ "):
                continue
            printed = []
            for after in lines[i + 1:]:
                if not after.strip() or after.lstrip().startswith("$ "):
                    break
                printed.append(after.strip())
            found.append((doc.relative_to(REPO).as_posix(), line.strip().removeprefix("$ "), printed))
    return found


EXAMPLES = dollar_examples()


def test_the_documents_have_dollar_examples():
    assert any(doc == "README.md" for doc, _, _ in EXAMPLES), "README.md lost its Mistakes example"


@pytest.mark.parametrize(("doc", "command", "printed"), EXAMPLES, ids=[f"{d}:{c}" for d, c, _ in EXAMPLES])
def test_a_dollar_example_prints_what_the_document_shows(doc, command, printed, tmp_path: Path):
    assert printed, f"{doc}: `$ {command}` shows no printed line"
    m = re.fullmatch(r"python -m (dtk[\w.]*)(.*)", command)
    assert m, f"{doc}: `$ {command}`: only python -m dtk... examples are run here"
    proc = run_main(m.group(1), *shlex.split(m.group(2)), cwd=tmp_path)  # an empty folder: runs/ would land here
    got = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert got == printed, f"{doc}: `$ {command}` printed:\n" + "\n".join(got)
    if printed[0].startswith("error:"):
        assert proc.returncode == 2 and not any(tmp_path.iterdir()), f"{doc}: `$ {command}` wrote files"
