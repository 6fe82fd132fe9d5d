"""scripts/setup.sh --shared: a team's install that every user can run. A python in a
private home (root's pyenv, mode 0700) is refused with one line naming PYTHON=, as root and
as a real non-root user; so is a venv made from one, and a checkout others cannot read.
The refusals come before anything is installed; nothing here downloads a package."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import access_support as acc
from conftest import REPO, require

SYSTEM_PYTHON = "/usr/bin/python3"
PREFIX = "dtksetup"  # this module's user (access_support.remove_all)
USER = f"{PREFIX}-user"


def checkout(folder: Path) -> Path:
    """The two scripts a refusal needs, in a checkout of their own (setup.sh works in the
    folder above its own)."""
    (folder / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "check_python.py"):
        shutil.copy(REPO / "scripts" / name, folder / "scripts" / name)
    return folder


def private_python(folder: Path) -> Path:
    """A python only its owner reaches: a link in a folder of mode 0700 (a pyenv in a home)."""
    folder.mkdir(mode=0o700)
    link = folder / "python3"
    link.symlink_to(os.path.realpath(SYSTEM_PYTHON))
    return link


def setup(co: Path, *args: str, python: str | None = None, user: str | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(co), **({"PYTHON": python} if python else {})}
    argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "bash", str(co / "scripts" / "setup.sh"), *args]
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def refused(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


@pytest.fixture
def base(tmp_path):
    require(os.path.isfile(SYSTEM_PYTHON), f"{SYSTEM_PYTHON} is needed as the shareable interpreter")
    require(os.geteuid() == 0 and shutil.which("runuser") is not None and shutil.which("useradd") is not None,
            "root, runuser and useradd are needed to check what other users can run")
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:  # pytest's own folders: others must reach the checkout
        if parent == Path("/tmp"):
            break
        parent.chmod(parent.stat().st_mode | 0o005)
    return tmp_path


def test_a_shared_install_refuses_a_python_others_cannot_run(base):
    co = checkout(base / "co")
    link = private_python(base / "private")
    nobody = subprocess.run(["runuser", "-u", "nobody", "--", str(link), "-c", "pass"], capture_output=True, check=False)
    assert nobody.returncode != 0  # what the refusal protects against: "Permission denied" for every other user
    err = refused(setup(co, "--shared", python=str(link)))
    assert f"error: {link} cannot be run by other users ({base / 'private'} is drwx------)" in err, err
    assert f"PYTHON={SYSTEM_PYTHON} bash scripts/setup.sh --shared" in err
    assert not (co / ".venv").exists()
    # A venv made from it earlier is refused too, and so is a checkout others cannot read.
    subprocess.run([str(link), "-m", "venv", "--without-pip", str(co / ".venv")], check=True)
    err = refused(setup(co, "--shared", python=SYSTEM_PYTHON))
    assert ".venv was made from an interpreter other users cannot run" in err and "rm -rf .venv" in err, err
    hidden = base / "hidden"
    hidden.mkdir(mode=0o700)
    err = refused(setup(checkout(hidden / "co"), "--shared", python=SYSTEM_PYTHON))
    assert f"the checkout {hidden / 'co'} cannot be read by other users ({hidden} is drwx------)" in err, err
    # The system's python passes, and other users can indeed run it.
    ok = subprocess.run([SYSTEM_PYTHON, str(co / "scripts" / "check_python.py"), str(co)], capture_output=True,
                        text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert subprocess.run(["runuser", "-u", "nobody", "--", SYSTEM_PYTHON, "-c", "pass"], check=False).returncode == 0


def test_a_user_with_a_private_python_is_told_which_python_to_use(base):
    acc.remove_all(PREFIX)
    try:
        acc.make_users({USER: []})
        co = checkout(base / "co")
        link = private_python(base / "private")
        acc.run(["chown", "-R", USER, str(co), str(base / "private")])
        err = refused(setup(co, "--shared", python=str(link), user=USER))
        assert f"{link} cannot be run by other users" in err and f"PYTHON={SYSTEM_PYTHON}" in err, err
        assert not (co / ".venv").exists()
        check = acc.as_user(USER, [SYSTEM_PYTHON, str(co / "scripts" / "check_python.py"), str(co)], cwd=co)
        assert check.returncode == 0, check.stderr
        assert "unknown option --sharde" in refused(setup(co, "--sharde", user=USER))
    finally:
        acc.remove_all(PREFIX)
