"""What the docs and dtk's own messages tell users to install names the distribution,
`dtk-train`: "dtk" on the package index is an unrelated project, so `pip install "dtk[hf]"`
installs that one (pyproject.toml's [project] name)."""

from __future__ import annotations

import re

import tomllib

from conftest import REPO

EXTRA = re.compile(r"(?<![\w.-])dtk\[")  # an extra of a distribution named "dtk"


def user_text():
    for pattern in ("docs/**/*.md", "*.md", "dtk/**/*.py", "conf/**/*.yaml", "pyproject.toml", "scripts/*"):
        yield from (p for p in REPO.glob(pattern) if p.is_file())


def test_install_lines_name_the_dtk_train_distribution():
    name = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"]
    assert name == "dtk-train"
    found = [f"{p.relative_to(REPO)}:{n}" for p in user_text()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if EXTRA.search(line)]
    assert found == [], f"an extra of the wrong distribution (use {name}[...]): {found}"
    assert 'pip install "dtk-train[hf]"' in (REPO / "docs/reference.md").read_text()
