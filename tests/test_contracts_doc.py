"""CONTRIBUTING.md's table of contracts names, for each, the test that runs it for real: every
test it names exists, and is a slow (end-to-end) test, so a renamed or deleted one shows
here instead of leaving a contract without its real run. A fast test may stand there only
when it starts the real command itself (`dtk(...)`, a `python -m` process)."""

from __future__ import annotations

import re

from conftest import REPO

SECTION = "## Contracts and the tests that run them for real"


def named_tests() -> list[tuple[str, str]]:
    """(test file, test function) for every test the table names; `::name` after a file
    continues with that file."""
    text = (REPO / "CONTRIBUTING.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    found = []
    for row in (line for line in text.splitlines() if line.startswith("| ") and "---" not in line):
        current = None
        for file, name in re.findall(r"(tests/\w+\.py)?::(\w+)", row.split(" | ", 1)[1]):
            current = file or current
            assert current, f"a test without its file in: {row}"
            found.append((current, name))
    return found


def test_every_test_the_contracts_table_names_exists_and_runs_for_real():
    named = named_tests()
    assert len(named) >= 30, named
    for file, name in named:
        source = (REPO / file).read_text()
        match = re.search(rf"^((?:@.*\n)*)def {name}\(", source, flags=re.M)
        assert match, f"CONTRIBUTING.md names {file}::{name}, which does not exist"
        module_slow = re.search(r"^pytestmark = .*pytest\.mark\.slow", source, flags=re.M)
        body = source[match.end():].split("\ndef ", 1)[0]
        real = module_slow or "pytest.mark.slow" in match.group(1) or re.search(r"\bdtk\(", body)
        assert real, f"{file}::{name} is neither an end-to-end (slow) test nor starts the real command"
