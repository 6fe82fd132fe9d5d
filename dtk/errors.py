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
    """argparse whose usage mistakes read like every other dtk error: one `error:` line
    (no usage block), exit 2 through run_cli. Subparsers inherit it."""

    def error(self, message: str) -> NoReturn:
        command = " ".join(self.prog.split()[:3])  # "python -m dtk.lab", also from "... dtk.lab up"
        raise UserError(f"{message} (see {command} --help)")

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", ArgumentParser)
        return super().add_subparsers(**kwargs)


def fail(message: str) -> NoReturn:
    first = " ".join(str(message).split())  # one line, whatever the source wrapped
    print(f"error: {first}", file=sys.stderr)
    sys.exit(2)


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> NoReturn:
    """Run a command's main; user errors become one `error:` line and exit code 2."""
    try:
        code = main(sys.argv[1:] if argv is None else argv)
    except UserError as exc:
        fail(str(exc))
    except BrokenPipeError:  # `python -m dtk.plan --help | head` is not an error
        sys.stderr.close()
        sys.exit(0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
