"""The one check of a node name, for every name that may reach Slurm or a batch script.

Node names come from files anyone who may write a run root can write (every run's
`excluded_nodes.json`, read for the root's reputation), from the config
(`cluster.exclude_from`), from Slurm (a lost or spare node) and from the command line
(`python -m dtk.nodes --readmit`). They end up in `#SBATCH --exclude=` of the next
submission, in a job's ExcNodeList and in srun's `-w`. A `#SBATCH` line is a shell
comment: quoting does not keep a newline from ending it, and whatever follows runs as the
user who submits. So each name passes `is_node_name` first, wherever it comes from; a
name that fails is left out (`split`, with a warning that shows it escaped) and shown as
invalid by `python -m dtk.nodes` and `python -m dtk.watch`.

The grammar is Slurm's hostlist for one name: ASCII letters, digits, `-`, `_` and `.`,
starting with a letter or a digit, and bracket ranges of numbers like `node[1-3,5]`.

Stdlib only: `dtk.watch` runs it from cron on a login node.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TypeGuard

MAX_LEN = 255
_RANGE = r"\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\]"
_NAME = re.compile(rf"[A-Za-z0-9](?:[A-Za-z0-9._-]|{_RANGE})*")


def is_node_name(name: object) -> TypeGuard[str]:
    """A node name (or a bracket range of them) in Slurm's hostlist grammar."""
    return isinstance(name, str) and len(name) <= MAX_LEN and _NAME.fullmatch(name) is not None


def shown(text: object) -> str:
    """`text` as it may be printed: as it is when it is printable ASCII, else escaped like
    Python's ascii() (a newline shows as \\n), so no name can end or forge a line."""
    if isinstance(text, str) and text.isascii() and text.isprintable():
        return text
    return ascii(text)


def split(names: Iterable[object]) -> tuple[list[str], list[object]]:
    """(the valid names, the invalid ones), each in the given order."""
    valid: list[str] = []
    invalid: list[object] = []
    for name in names:
        if is_node_name(name):
            valid.append(name)
        else:
            invalid.append(name)
    return valid, invalid


def warning(invalid: Iterable[object], *, source: str) -> str:
    """One line that says which names were left out, and from where."""
    names = ", ".join(shown(n) for n in invalid)
    return (f"warning: left out invalid node name(s) from {source}: {names} (a node name is letters, digits,"
            " '-', '_', '.' and ranges like node[1-3,5])")
