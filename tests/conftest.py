"""Shared test helpers: run dtk's real commands, and skip-or-fail for missing capabilities."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"

# Bytecode is cached for the test modules (pytest keeps their assertion-rewritten code beside
# them) and for the commands the tests start, also where the environment says not to
# (PYTHONDONTWRITEBYTECODE=1): without it every collection rewrites and compiles ~130 test
# modules again, 3 s of CPU per pytest process.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def require(condition: bool, reason: str) -> None:
    """Skip when the machine cannot run a test; under CI=true that is a failure instead,
    so CI never passes by skipping."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI cannot run this test: {reason}")
    pytest.skip(reason)


def dtk(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m <args>` as a user would (`dtk("dtk.submit", "nodes=1")`); a first
    argument starting with `-` is an interpreter flag (`dtk("-X", "importtime", "-m", ...)`)."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    argv = [sys.executable, *args] if args[0].startswith("-") else [sys.executable, "-m", *args]
    return subprocess.run(
        argv,
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass(frozen=True)
class Ran:
    """What a command run in this process left: the fields of subprocess.CompletedProcess
    that tests read, so a test can switch between `run_main` and `dtk` freely."""

    returncode: int
    stdout: str
    stderr: str


def _command_main(module: str):
    """The main(argv) that `python -m MODULE` runs: a package's is in its __main__.py
    (dtk.worker's __main__ runs at import, so its main is taken from dtk.worker.main)."""
    if module == "dtk.worker":
        return importlib.import_module("dtk.worker.main").main
    found = importlib.import_module(module)
    if hasattr(found, "__path__"):
        found = importlib.import_module(f"{module}.__main__")
    return found.main


def run_main(module: str, *args: str, cwd: Path | None = None, env: dict | None = None) -> Ran:
    """Run `python -m MODULE ARGS` inside this process: the command's `main(argv)` through
    dtk.common.errors.run_cli (so a UserError is one `error:` line and exit 2, as from a shell),
    with stdout and stderr captured and the exit code taken from its SystemExit.

    The fast way to test a command's output, exit code and what it writes: no interpreter
    start, no second import of hydra. It runs in `cwd` (default: the repository) with `env`
    and PYTHONPATH=REPO added to os.environ, and puts back the working folder, os.environ, sys.path and the
    modules a project folder brought in. Use `dtk(...)` instead where the process itself is
    what is tested: what a command imports (no torch on the login node), signals, a real
    entry point (`python -m ...`), or a command that starts workers.
    An exception other than a UserError propagates, so the test shows its traceback."""
    from dtk.common.errors import run_cli

    main = _command_main(module)
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_path, saved_modules = dict(os.environ), list(sys.path), set(sys.modules)
    old_cwd = os.getcwd()
    try:
        os.chdir(cwd or REPO)
        # As dtk(...) runs a command: the checkout importable by the subprocesses it starts
        # (the planner counts a user's model in one), whatever the caller's environment.
        os.environ.update({"PYTHONPATH": str(REPO), **(env or {})})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run_cli(main, list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if isinstance(exc.code, str):  # sys.exit("message"), as the interpreter prints it
                    print(exc.code, file=sys.stderr)
            else:  # run_cli always exits; reaching here would be a change of its contract
                raise AssertionError("dtk.common.errors.run_cli returned instead of exiting")
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        # A project folder's own modules (conf of another test may name the same module).
        for name in set(sys.modules) - saved_modules:
            path = getattr(sys.modules[name], "__file__", None) or ""
            if path and not path.startswith((str(REPO / "dtk"), sys.prefix, sys.base_prefix)):
                del sys.modules[name]
    return Ran(code, out.getvalue(), err.getvalue())


def losses(run_dir: Path) -> dict[int, float]:
    """Per step, the latest logged loss (a step redone after a restart replaces the earlier one)."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def run_dirs(root: Path) -> list[Path]:
    """The run directories under a run root (not its audit/ log, which every submission writes)."""
    from dtk.common.audit import AUDIT_DIR

    return [p for p in root.iterdir() if p.is_dir() and p.name != AUDIT_DIR]


def only_run_dir(root: Path) -> Path:
    runs = run_dirs(root)
    assert len(runs) == 1, f"expected one run directory in {root}, found {runs}"
    return runs[0]


@pytest.fixture(scope="session")
def lab_reference(tmp_path_factory) -> dict[int, float]:
    """The losses of the lab drills' job run without a fault: lab_support.TRAIN on 2 local
    workers (the same world size), once per session for every module that compares to it."""
    from lab_support import TRAIN

    root = tmp_path_factory.mktemp("lab_reference")
    proc = dtk("dtk.submit", "tasks_per_node=2", *TRAIN, f"run.root={root}", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return losses(only_run_dir(root))


@pytest.fixture(scope="session")
def lab():
    """The lab Slurm cluster with 3 nodes, up for the session and down at its end (if this
    session brought it up). The lab is this pytest process's session for as long
    (dtk.lab.session, `DTK_LAB_SESSION`: its own `python -m dtk.lab` subprocesses are of it):
    a person's `up` or `down` in the meantime is refused, and a lab another session holds
    makes the lab's tests skip (fail under CI=true) with that session's name."""
    import lab_support
    from dtk import lab as dtk_lab

    was_up = lab_support.unavailable_reason() is None and dtk_lab.status().up
    status = lab_support.ensure_lab(3)
    yield status
    if not was_up:
        lab_support.lab_down()
    else:
        lab_support.lab_release()


@contextlib.contextmanager
def s3_server():
    """moto's S3 server on a free port of 127.0.0.1 (reachable from the lab's nodes, which
    share this host's network); yields the environment a client needs (set in this process
    while it runs: the endpoint by AWS_ENDPOINT_URL_S3, any key and secret, as a user points
    dtk at an S3-compatible store, and inherited by what it starts, a Slurm job too) and
    stops the server at the end."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # moto takes any key; a secret no file would hold by chance, so a test can look for it
    env = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": f"dtk-test-secret-{port}", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def new_bucket() -> str:
    """A fresh bucket on the server the environment points at (`s3_server`)."""
    import uuid

    from dtk.common.storage import FsspecStorage, open_storage

    name = f"dtk-{uuid.uuid4().hex[:12]}"
    store = open_storage(f"s3://{name}")
    assert isinstance(store, FsspecStorage)
    store.fs.mkdir(name)
    return name


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server for a test module's tests (`s3_server`)."""
    with s3_server() as env:
        yield env


LAB_GROUP = "lab"
GROUPS_KEY = "dtk_groups"  # the folder where each xdist worker writes the lab's test ids


def uses_lab(item) -> bool:
    """Whether a test uses the lab: marked `slurm`, or asking for the `lab` fixture."""
    return item.get_closest_marker("slurm") is not None or "lab" in getattr(item, "fixturenames", ())


def group_of(nodeid: str, lab_ids: set[str]) -> str:
    """The xdist group a test runs in: every test of the lab in one group, run one after the
    other (there is one lab on a machine, and its tests restart, drain and fail its nodes);
    every other test in its file's group, so a module's fixtures (a reference run) are made
    once. An id that names its group itself (`ID@GROUP`, xdist's own form) keeps it."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[1]
    if nodeid in lab_ids:
        return LAB_GROUP
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The lab's tests carry `xdist_group("lab")`, and under `--dist loadgroup` each xdist
    worker writes their ids where the controller's scheduler (LabGroupScheduling) reads them.

    xdist 3.8 names a marked test `ID@GROUP` through `item._nodeid`, which pytest 9 no longer
    reads, so the marker alone does not group: the scheduler does, from the ids."""
    lab_ids = [item.nodeid for item in items if uses_lab(item)]
    for item in items:
        if item.nodeid in lab_ids:
            item.add_marker(pytest.mark.xdist_group(LAB_GROUP))
    folder = getattr(config, "workerinput", {}).get(GROUPS_KEY)
    if folder:
        worker = config.workerinput["workerid"]
        (Path(folder) / f"{worker}.json").write_text(json.dumps(lab_ids))


class XdistGroups:
    """Registered in the xdist controller under `--dist loadgroup`: hands each worker the
    folder for its lab ids (xdist's public `pytest_configure_node`) and schedules by
    `group_of` (xdist's public `pytest_xdist_make_scheduler`)."""

    def __init__(self) -> None:
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="dtk-xdist-groups-"))

    def pytest_configure_node(self, node) -> None:
        node.workerinput[GROUPS_KEY] = str(self.folder)

    def pytest_xdist_make_scheduler(self, config, log):
        from xdist.scheduler import LoadScopeScheduling

        folder = self.folder

        class LabGroupScheduling(LoadScopeScheduling):
            """xdist's loadscope scheduling, with the scope of a test its `group_of`.
            Called only once every worker has collected, so every worker's ids are written."""

            lab_ids: set[str] | None = None

            def _split_scope(self, nodeid: str) -> str:
                if self.lab_ids is None:
                    self.lab_ids = set()
                    for path in folder.glob("*.json"):
                        self.lab_ids.update(json.loads(path.read_text()))
                return group_of(nodeid, self.lab_ids)

        return LabGroupScheduling(config, log)

    def pytest_unconfigure(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def pytest_configure(config):
    """In the xdist controller under `--dist loadgroup`, schedule by group (XdistGroups)."""
    controller = config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
    if controller and config.getoption("dist", "no") == "loadgroup" and config.getoption("numprocesses", None):
        config.pluginmanager.register(XdistGroups(), "dtk-xdist-groups")
