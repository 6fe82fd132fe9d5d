"""python -m dtk.config.reference [--write | --check]: docs/reference.md from the schemas.

The reference is generated, never edited: every key with its type, default and doc
string, in the order `dtk.config.docs.sections` walks the schemas. Without a flag the
text goes to stdout; `--write` replaces docs/reference.md; `--check` exits 1 when the file
differs from what the schemas say now (the test suite runs the same comparison).
"""

from __future__ import annotations

import sys
from pathlib import Path

from dtk.common.errors import ArgumentParser, run_cli
from dtk.config.docs import Section, sections

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
COMMAND = "python -m dtk.config.reference --write"

HEADER = f"""# Configuration reference

Every configuration key with its type, default and meaning. Set a key on the command line
as `KEY=VALUE` (`python -m dtk.submit train.steps=500 cluster=lab`); choose a group's
option as `GROUP=OPTION` (`data=hdf5`), and the parallelism scheme with `+scheme=NAME`.
`python -m dtk.plan --help` prints the same list.

Generated from the field doc strings in `dtk/config/schema.py` by `{COMMAND}`;
do not edit by hand: `tests/test_reference.py` fails when this file and the schemas differ.
A default of `required` means the key has none and must be given. `[identity]` marks a key
that is part of what a run computes: set away from its default, it names another run
(docs/recovery.md, "Identity and upgrades"); every other key continues the same run.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _title(section: Section) -> str:
    if not section.prefix:
        return "Top level"
    if section.option is not None:
        return f"`{section.prefix}` with `{section.prefix}={section.option}`"
    return f"`{section.prefix}`"


def render() -> str:
    parts = [HEADER]
    for section in sections():
        if not section.keys:
            continue
        parts.append(f"## {_title(section)}\n")
        if section.doc:
            parts.append(f"{section.doc}\n")
        rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        rows += [f"| `{k.key}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {_cell(k.doc)} |" for k in section.keys]
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m dtk.config.reference", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"replace {REFERENCE.name} in docs/")
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/reference.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        REFERENCE.write_text(text)
        print(f"wrote {REFERENCE}")
        return 0
    if args.check:
        current = REFERENCE.read_text() if REFERENCE.is_file() else ""
        if current != text:
            print(f"{REFERENCE} is out of date with the schemas; regenerate it: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    run_cli(main)
