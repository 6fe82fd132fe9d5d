"""A command run from the folder that holds a checkout named `dtk`: Python imports that folder
as the package (the current folder leads the import path; with no __init__.py it is a
namespace package), and the command says so in one line instead of a traceback that
advises a reinstall."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _python(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user's shell has it
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", [["dtk.init", "myproj"], ["dtk.data", "info", "data"]])
def test_a_folder_named_dtk_in_the_current_folder_is_named_in_one_error_line(command, tmp_path):
    checkout = tmp_path / "dtk"
    (checkout / "dtk").mkdir(parents=True)  # a checkout: its package is one level down
    (checkout / "README.md").write_text("a checkout of dtk\n")
    probe = _python("-c", "import dtk; print(getattr(dtk, '__file__', None) is None)", cwd=tmp_path)
    shadowed = probe.stdout.strip() == "True"
    proc = _python("-m", *command, cwd=tmp_path)
    if not shadowed:  # an install whose dtk wins over the folder (a wheel, a path entry): nothing to say
        assert "Python imported the package dtk" not in proc.stderr
        return
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: Python imported the package dtk from the folder {checkout}, not from the"
                                  " installed dtk (")
    assert "run dtk commands from another folder" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dtk"]  # nothing written

