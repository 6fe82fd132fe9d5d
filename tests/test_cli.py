"""The command surface, frozen: every `python -m dtk.*` command parses its arguments with
dtk.common.errors.ArgumentParser, and its flags are exactly those listed in FROZEN.

A new command or flag is a deliberate change: add it to FROZEN in the same commit as the
code, the docs (README.md, docs/) and its tests. Habit from torchtitan's
tests/unit_tests/test_no_new_cli_options.py: argparse sprawl is easy to grow and hard to
take back.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re

import pytest

from conftest import REPO, run_main
from dtk.common.errors import ArgumentParser, UserError

# command (and subcommand) -> its options and positionals (METAVAR, "..." for several,
# {allowed,values}).
FROZEN: dict[str, list[str]] = {
    "dtk.access audit": ["RUN_ROOT"],
    "dtk.access prepare": ["--policy", "team"],
    "dtk.access show": ["policy"],
    "dtk.bench matmul": ["--out"],
    "dtk.bench scaling": ["--out", "KEY=VALUE ..."],
    "dtk.checkpoint delete": ["--force", "--step", "RUN_DIR"],
    "dtk.checkpoint export": ["--format {torch,safetensors,hf}", "--out", "--step", "RUN_DIR"],
    "dtk.checkpoint list": ["--json", "--no-checksums", "RUN_DIR"],
    "dtk.config.reference": ["--check", "--write"],
    "dtk.data info": ["path"],
    "dtk.data prepare": ["--force", "--input", "--out", "--samples-per-shard", "--seq-len", "--tokenizer", "--val-fraction"],
    "dtk.data verify": ["path"],
    "dtk.doctor": ["KEY=VALUE ..."],
    "dtk.doctor.worker": ["OUT"],
    "dtk.drill": ["--at-step", "--full", "--hold", "--rank", "--steps", "kind {preempt,timelimit,node-fail,crash,hang,storage,nan}",
                  "run_dir"],
    "dtk.handover": ["--out", "RUN_DIR"],
    "dtk.init": ["--name", "DIR"],
    "dtk.lab down": ["--force", "--take"],
    "dtk.lab slow": ["NODE", "RATE"],
    "dtk.lab status": [],
    "dtk.lab up": ["--access", "--force", "--gpus-per-node", "--netns", "--no-install", "--nodes", "--preempt-mode {cancel,requeue}",
                   "--take", "--timeout"],
    "dtk.nodes": ["--json", "--readmit", "RUN_DIR|RUN_ROOT"],
    "dtk.parallel.count": ["(no arguments)"],
    "dtk.worker.forkserver": ["(no arguments)"],  # the local driver's worker factory, fed on stdin
    "dtk.plan": ["--config-dir", "--json", "KEY=VALUE ..."],
    "dtk.report": ["--baseline", "--json", "--no-plots", "--out", "--tolerance", "RUN_DIR ..."],
    "dtk.status": ["--json", "RUN_DIR"],
    "dtk.stop": ["--now", "--timeout", "RUN_DIR"],
    "dtk.submit": ["--config-dir", "-m/--multirun", "KEY=VALUE ..."],
    "dtk.topology choose": ["--backend {nccl,gloo}", "--tasks-per-node", "DIR ..."],
    "dtk.topology discover": ["--out"],
    "dtk.topology record": ["dir"],
    "dtk.topology show": ["--json"],
    "dtk.watch": ["--alert", "--json", "--once", "RUN_ROOT"],
    "dtk.worker": ["RUN_DIR"],
}


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def commands() -> dict[str, str]:
    """`python -m` name -> the module whose main(argv) parses, for every module of dtk that
    runs as a command."""
    found = {}
    for path in sorted((REPO / "dtk").rglob("*.py")):
        text = path.read_text()
        if path.name != "__main__.py" and '__name__ == "__main__"' not in text:
            continue
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        name = module.removesuffix(".__main__")
        # dtk/worker/__main__.py runs at import (a worker process); its main lives beside it.
        found[name] = "dtk.worker.main" if name == "dtk.worker" else module
    return found


def parser_of(module: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser a command's main builds, caught at its first parse."""
    def capture(self, *args, **kwargs):
        raise _Captured(self)

    monkeypatch.setattr(ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(ArgumentParser, "parse_intermixed_args", capture)
    main = importlib.import_module(module).main
    with pytest.raises(_Captured) as caught:
        main([])
    return caught.value.parser


def surface(parser: argparse.ArgumentParser, name: str) -> dict[str, list[str]]:
    flags: list[str] = []
    subs: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                assert isinstance(sub, ArgumentParser), f"{name} {sub_name}: not a dtk.common.errors.ArgumentParser"
                subs.update(surface(sub, f"{name} {sub_name}"))
        else:
            name_ = "/".join(action.option_strings) or action.metavar or action.dest
            several = not action.option_strings and action.nargs in ("*", "+")
            choices = f" {{{','.join(map(str, action.choices))}}}" if action.choices else ""
            flags.append(name_ + (" ..." if several else "") + choices)
    return subs or {name: sorted(flags)}


def test_every_command_parses_with_the_shared_parser_and_its_flags_are_frozen(monkeypatch):
    seen: dict[str, list[str]] = {}
    for name, module in commands().items():
        main = importlib.import_module(module).main
        if not inspect.signature(main).parameters:  # an internal step fed on stdin (dtk.parallel.count)
            seen[name] = ["(no arguments)"]
            continue
        parser = parser_of(module, monkeypatch)
        assert isinstance(parser, ArgumentParser), f"python -m {name} does not parse with dtk.common.errors.ArgumentParser"
        assert parser.prog == f"python -m {name}", parser.prog
        seen.update(surface(parser, name))
    assert seen == FROZEN, "the command surface changed: update FROZEN on purpose (and the docs)"


def test_overrides_are_checked_for_their_shape_before_hydra_sees_them():
    from dtk.common.errors import override

    for good in ("nodes=2", "+scheme=fsdp", "++train.steps=3", "~checkpoint.every", "~extra.x=1", "optim.lr=1e-3,3e-4"):
        assert override(good) == good
    for bad in ("=1", "=", "+=1", "~", "nodes", "++"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            override(bad)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["dtk.plan", "=1"], "error: argument KEY=VALUE: override '=1' has no key before '='"),
        (["dtk.plan", "nodes"], "error: argument KEY=VALUE: override 'nodes' is not KEY=VALUE"),
        (["dtk.plan", "--bogus"], "error: unrecognized arguments: --bogus (see python -m dtk.plan --help)"),
        (["dtk.plan", "cluster=1"], "error: cluster=1: "),
        (["dtk.submit", "--json"], "error: unrecognized arguments: --json (see python -m dtk.submit --help)"),
        (["dtk.status"], "error: the following arguments are required: RUN_DIR"),
        (["dtk.status", "a", "b"], "error: unrecognized arguments: b"),
    ],
)
def test_usage_mistakes_are_one_error_line_with_exit_2(args, needle, tmp_path):
    proc = run_main(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(needle) and proc.stderr.count("\n") == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_overrides_and_flags_mix_in_any_order():
    from dtk.plan.__main__ import build_parser as plan_parser
    from dtk.submit.__main__ import build_parser as submit_parser

    args = submit_parser().parse_intermixed_args(["nodes=1", "-m", "optim.lr=1,2", "+scheme=ddp"])
    assert args.multirun and args.overrides == ["nodes=1", "optim.lr=1,2", "+scheme=ddp"]
    args = plan_parser().parse_intermixed_args(["--json", "train.steps=3"])
    assert args.json and args.overrides == ["train.steps=3"]


def test_help_is_exit_0_and_lists_the_surface(tmp_path):
    proc = run_main("dtk.submit", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "-m, --multirun" in proc.stdout and "KEY=VALUE" in proc.stdout
    proc = run_main("dtk.plan", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "train.global_batch" in proc.stdout and "--json" in proc.stdout


def test_no_abbreviated_flags():
    parser = ArgumentParser(prog="python -m dtk.x")
    parser.add_argument("--json", action="store_true")
    with pytest.raises(UserError, match="unrecognized arguments: --js"):
        parser.parse_args(["--js"])


def test_a_sweep_still_expands_with_m_anywhere_on_the_line(tmp_path):
    proc = run_main("dtk.submit", "optim.lr=1e-3,3e-4", "submit.dry_run=true", "-m", "train.steps=5", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    points = [ln for ln in proc.stdout.splitlines() if ln.startswith("=== ")]
    assert len(points) == 2 and all("submit.dry_run=true" in p and "train.steps=5" in p for p in points), points
    assert list(tmp_path.iterdir()) == []
