"""A job queued by an earlier release still runs: its pickles name modules by their old paths
(dtk/common/moved.py, MOVED and SYMBOLS), and those names import as today's modules."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys

import pytest

from conftest import REPO
from dtk.common import moved


@pytest.mark.parametrize("old", sorted(moved.MOVED))
def test_every_old_module_imports_as_its_new_module(old):
    module = importlib.import_module(old)
    new = importlib.import_module(moved.MOVED[old])
    public = [n for n in vars(new) if not n.startswith("_")]
    assert all(getattr(module, n) is getattr(new, n) for n in public), old
    assert new.__spec__.name == moved.MOVED[old]  # the new module is left as it is


def test_a_symbol_that_left_its_module_is_found_where_it_went():
    for full, home in moved.SYMBOLS.items():
        old, _, name = full.rpartition(".")
        assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(home), name), full


def test_a_pickle_naming_old_module_paths_loads_and_runs(tmp_path):
    """Pickles written by the previous release, by hand: protocol 0 names a global as
    `c<module>\\n<name>\\n`, so the old paths are spelled exactly as that release wrote them."""
    from dtk.common.processes import pid_alive
    from dtk.common.rundir import RunDir

    # pid_alive(os.getpid()) as `dtk.rundir.pid_alive`, a name that left its module
    call = f"cdtk.rundir\npid_alive\n(I{os.getpid()}\ntR.".encode()
    assert pickle.loads(call) is True
    # RunDir(tmp_path) as `dtk.rundir.RunDir`: the class is today's
    run = pickle.loads(f"cdtk.rundir\nRunDir\n(cpathlib\nPosixPath\n(V{tmp_path}\ntRtR.".encode())
    assert type(run) is RunDir and run.path == tmp_path
    assert pickle.loads(b"cdtk.dist.mesh\nParallelMesh\n.") is importlib.import_module("dtk.mesh.mesh").ParallelMesh
    assert pickle.loads(b"cdtk.start\nsubmit_inputs\n.") is importlib.import_module("dtk.submit.start").submit_inputs
    # a checkpoint store as `dtk.checkpoint.storage.LocalStorage`, the module's path until it moved to dtk.common
    store = pickle.loads(f"cdtk.checkpoint.storage\nLocalStorage\n(cpathlib\nPosixPath\n(V{tmp_path}\ntRtR.".encode())
    assert type(store) is importlib.import_module("dtk.common.storage").LocalStorage and store.path == tmp_path
    assert pid_alive(os.getpid())


def test_what_submitit_pickles_for_a_queued_job_loads_and_runs(tmp_path):
    """dtk.submit.start hands submitit `drive(run_dir)`; submitit pickles it as a
    DelayedSubmission (cloudpickle, by reference). One naming an old module path, loaded in
    a fresh interpreter as the batch script does, runs."""
    submitit = pytest.importorskip("submitit")
    from dtk.common.processes import pid_alive
    from dtk.driver.supervisor import drive

    queued = pickle.dumps(submitit.helpers.DelayedSubmission(drive, str(tmp_path)), protocol=0)
    assert b"cdtk.driver.supervisor\ndrive\n" in queued  # what the batch script imports today
    old = pickle.dumps(submitit.helpers.DelayedSubmission(pid_alive, os.getpid()), protocol=0)
    old = old.replace(b"cdtk.common.processes\npid_alive\n", b"cdtk.rundir\npid_alive\n")
    assert b"dtk.common" not in old
    path = tmp_path / "submitted.pkl"
    path.write_bytes(old)
    code = ("import pickle, sys; job = pickle.load(open(sys.argv[1], 'rb')); "
            "assert job.result() is True; print('ran', job.function.__module__)")
    ran = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=tmp_path, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "ran dtk.common.processes"
