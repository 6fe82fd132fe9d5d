"""User errors and the one way a command reports them: `error: ...` on stderr, exit 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn


class UserError(ValueError):
    """A mistake in what the user asked for. The message is one line that names the key,
    the value, and what would work."""


class Unanswered(RuntimeError):
    """A service a command needs did not answer in time (slurmctld): not the user's mistake,
    but nothing a traceback would explain. A command ends with one `error:` line and exit 2,
    having changed nothing; a driver retries or decides on its own."""


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every `python -m dtk.*` command: usage mistakes read like every other
    dtk error (one `error:` line, no usage block, exit 2 through run_cli); subparsers
    inherit it. No abbreviated flags: the surface is exactly the flags declared, and
    tests/test_cli.py freezes it."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def add_overrides(self) -> None:
        """Positional configuration overrides in Hydra's syntax, checked for their shape
        here (`override`); parse with `parse_intermixed_args` so flags may come anywhere."""
        self.add_argument("overrides", nargs="*", metavar="KEY=VALUE", type=override,
                          help="configuration overrides: key=value, +key=value (add), ~key (remove), "
                               "group=option (e.g. cluster=lab); the keys: python -m dtk.plan --help")

    def error(self, message: str) -> NoReturn:
        command = " ".join(self.prog.split()[:3])  # "python -m dtk.lab", also from "... dtk.lab up"
        raise UserError(f"{message} (see {command} --help)")

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", ArgumentParser)
        return super().add_subparsers(**kwargs)


def override(text: str) -> str:
    """One command-line override, checked for its shape only (Hydra parses the rest): a key,
    then `=` and a value; `~key` alone removes a key."""
    key, sep, _ = text.lstrip("+~").partition("=")
    if sep and not key.strip():
        raise argparse.ArgumentTypeError(f"override {text!r} has no key before '='; expected KEY=VALUE like train.steps=100")
    if not sep and not (text.startswith("~") and key.strip()):
        raise argparse.ArgumentTypeError(f"override {text!r} is not KEY=VALUE; expected like train.steps=100 or ~KEY")
    return text


def check_out(path: Path, *, folder: bool, flag: str = "--out") -> Path:
    """Where a command is told to write (`folder`: a folder it writes into, else one file):
    refused before anything is read or written when it names the other kind, or sits where
    nothing can be created (a file on the way, a folder this user cannot write). Tried for
    real, with a folder made and removed where the first existing part of the path is:
    permissions alone do not tell (root, ACLs, a read-only mount)."""
    import os
    import tempfile

    path = Path(path).expanduser()
    if path.exists() and path.is_dir() != folder:
        want = "a folder" if folder else "a file (or a new name)"
        raise UserError(f"{flag} {path}: is {'a folder' if path.is_dir() else 'a file'}; name {want}")
    existing = path if path.is_dir() else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: {existing} is a file, so nothing can be created under it; name another place")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dtk-probe-", dir=existing))
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot write in {existing} ({exc.strerror or exc}); name a folder you can"
                        " write") from None
    return path


def fail(message: str) -> NoReturn:
    first = " ".join(str(message).split())  # one line, whatever the source wrapped
    print(f"error: {first}", file=sys.stderr)
    sys.exit(2)


def shadowing_folder() -> str | None:
    """Why the package `dtk` is not dtk, or None. Run from the folder that holds a checkout
    named `dtk`, Python finds that folder first (the current folder leads the import path);
    having no __init__.py (the package is one level down, dtk/dtk) it imports as an empty
    namespace package, the installed dtk's modules still load through the editable install's
    finder, and dtk's package data is then looked for in the wrong folder."""
    import dtk

    if getattr(dtk, "__file__", None) is not None:
        return None
    where = ", ".join(str(p) for p in getattr(dtk, "__path__", [])) or "a namespace package"
    return (f"Python imported the package dtk from the folder {where}, not from the installed dtk"
            f" ({Path(__file__).resolve().parents[1]}): the current folder comes first on Python's import path, and a"
            " folder named dtk there without an __init__.py (such as a checkout of dtk) shadows the package;"
            " run dtk commands from another folder (cd into the checkout, or into your project)")


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None = None, *,
            on_denied: Callable[[str | None], str] | None = None) -> NoReturn:
    """Run a command's main; user errors become one `error:` line and exit code 2.
    `on_denied(filename)` says what a refused read or write means (the commands that act on
    team folders hand in dtk.access.check.explain_denied; errors imports no stage)."""
    shadow = shadowing_folder()
    if shadow is not None:
        fail(shadow)
    try:
        code = main(sys.argv[1:] if argv is None else argv)
    except UserError as exc:
        fail(str(exc))
    except Unanswered as exc:
        fail(f"{exc}. Is slurmctld up (scontrol ping)? Try again once it answers")
    except PermissionError as exc:
        # A file this user may not read or write: under an access policy that is the
        # policy speaking (docs/access.md), not a bug; say which file and who asked.
        import getpass

        why = on_denied(exc.filename) if on_denied is not None else (
            "under an access policy, reading runs takes the viewer role and changing them the run's user or the"
            " maintainer role (python -m dtk.access show POLICY says who holds which)")
        fail(f"{exc.filename or 'a file'}: {exc.strerror or 'permission denied'} for user {getpass.getuser()}; {why}")
    except BrokenPipeError:  # `python -m dtk.plan --help | head` is not an error
        sys.stderr.close()
        sys.exit(0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
