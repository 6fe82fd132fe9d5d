"""Can every user run this interpreter and the checkout? scripts/setup.sh --shared asks.

    PYTHON scripts/check_python.py CHECKOUT [SUGGESTED_PYTHON]

Run by the interpreter in question (a venv's python checks the interpreter it was made
from too). Exit 0 when every user can run it; otherwise one `error:` line naming the path
that keeps them out, and exit 2. "Every user" is what the mode bits give others: a shared
install serves every member of the team's roles, whatever their groups. Stdlib only.
"""

from __future__ import annotations

import os
import stat
import sys
import sysconfig


def blocked(path: str, *, leaf: int) -> str | None:
    """The first folder on the way to `path` that others cannot enter, or `path` itself
    when others lack `leaf` (the mode bits they need on it); None when nothing blocks.
    A link is followed hop by hop: a venv's python links to the one it was made from."""
    for _ in range(40):  # the kernel's own bound on links in a row
        path = os.path.abspath(path)
        parts = path.split(os.sep)
        for k in range(2, len(parts)):
            folder = os.sep.join(parts[:k])
            mode = os.stat(folder).st_mode
            if not mode & stat.S_IXOTH:
                return f"{folder} is {stat.filemode(mode)}"
        if not os.path.islink(path):
            break
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    mode = os.stat(path).st_mode
    if mode & leaf != leaf:
        return f"{path} is {stat.filemode(mode)}"
    return None


def main(argv: list[str]) -> int:
    checkout = argv[0] if argv else os.getcwd()
    suggested = argv[1] if len(argv) > 1 else None
    instead = (f"PYTHON={suggested} bash scripts/setup.sh --shared" if suggested else
               "PYTHON=PATH bash scripts/setup.sh --shared with a python every user can run (none found in /usr/bin"
               " or /usr/local/bin)")
    interpreters = {sys.executable, os.path.realpath(sys.executable)}
    base = getattr(sys, "_base_executable", sys.executable)  # a venv's python: the one it was made from
    interpreters |= {base, os.path.realpath(base)}
    needed = [(p, stat.S_IXOTH) for p in sorted(interpreters)]
    needed.append((sysconfig.get_paths()["stdlib"], stat.S_IROTH | stat.S_IXOTH))
    for path, leaf in needed:
        why = blocked(path, leaf=leaf)
        if why:
            print(f"error: {sys.executable} cannot be run by other users ({why}): a shared install needs an"
                  f" interpreter every member of the team can run; {instead}", file=sys.stderr)
            return 2
    why = blocked(checkout, leaf=stat.S_IROTH | stat.S_IXOTH)
    if why:
        print(f"error: the checkout {checkout} cannot be read by other users ({why}), and dtk runs from it; clone it"
              " into a shared folder (such as /opt/dtk) for a shared install", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
