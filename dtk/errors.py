"""User errors and the one way a command reports them: `error: ...` on stderr, exit 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(ValueError):
    """A mistake in what the user asked for. The message is one line that names the key,
    the value, and what would work."""


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


def fail(message: str) -> NoReturn:
    first = " ".join(str(message).split())  # one line, whatever the source wrapped
    print(f"error: {first}", file=sys.stderr)
    sys.exit(2)


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None = None, *,
            on_denied: Callable[[str | None], str] | None = None) -> NoReturn:
    """Run a command's main; user errors become one `error:` line and exit code 2.
    `on_denied(filename)` says what a refused read or write means (the commands that act on
    team folders hand in dtk.access.check.explain_denied; errors imports no stage)."""
    try:
        code = main(sys.argv[1:] if argv is None else argv)
    except UserError as exc:
        fail(str(exc))
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
