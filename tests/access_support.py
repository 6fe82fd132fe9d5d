"""Real Unix users and groups for the access tests, made by the test (as root) and removed
after it, and a way to run dtk as one of them.

The lab runs jobs as the submitting user, so that user must be able to run the python that
dtk runs under. A venv made from a python in root's home is not: then the users get a
venv of their own, from the system's python of the same version, that reaches dtk's
site-packages (read-only) through a .pth file.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the users import this checkout's dtk
PREFIX = "dtkacc"  # every user and group the tests make starts with it; leftovers of a killed run are removed


def run(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{' '.join(argv)}: {proc.stderr}"
    return proc


def remove_all(prefix: str = PREFIX) -> None:
    """Every user and group of a previous or this run (by prefix: each module has its own,
    so that two modules running at once never remove each other's users)."""
    for user in [p.pw_name for p in pwd.getpwall() if p.pw_name.startswith(prefix)]:
        subprocess.run(["userdel", user], capture_output=True, check=False)
    for group in [g.gr_name for g in grp.getgrall() if g.gr_name.startswith(prefix)]:
        subprocess.run(["groupdel", group], capture_output=True, check=False)


def make_users(users: dict[str, list[str]]) -> None:
    """{user: [groups]}: the groups first, then each user with no home and those groups."""
    for group in sorted({g for groups in users.values() for g in groups}):
        run(["groupadd", group])
    for user, groups in users.items():
        # -N: no group of the user's own name; the primary group is the system's default (users).
        run(["useradd", "-M", "-N", "-s", "/bin/sh", *(["-G", ",".join(groups)] if groups else []), user])


def runnable_by_others(python: str) -> bool:
    probe = subprocess.run(["runuser", "-u", "nobody", "--", python, "-c", "pass"], capture_output=True, check=False)
    return probe.returncode == 0


def user_python(base: Path) -> str | None:
    """A python every user can run with dtk importable, or None when none can be made."""
    if runnable_by_others(sys.executable):
        return sys.executable
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(version, path="/usr/bin:/usr/local/bin")
    if system is None or not runnable_by_others(system):
        return None
    venv = base / "venv"
    run([system, "-m", "venv", "--without-pip", str(venv)])
    site = Path(sysconfig.get_paths()["purelib"])
    (next(venv.glob("lib/python*/site-packages")) / "dtk-tests.pth").write_text(
        f"import site; site.addsitedir({str(site)!r})\n")
    run(["chmod", "-R", "a+rX", str(venv)])
    python = str(venv / "bin" / "python")
    return python if runnable_by_others(python) else None


def as_user(user: str, argv: list[str], *, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `argv` as `user` with the groups the group database gives them now."""
    fixed = {"HOME": str(cwd), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "MPLCONFIGDIR": f"/tmp/{user}-mpl",
             "PYTHONPATH": str(REPO), **(env or {})}
    cmd = ["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in fixed.items()), *argv]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def remove_team(team: Path) -> None:
    """A prepared team folder, with its append-only audit head (root clears the attribute)."""
    from dtk.access import acl

    head = team / "runs" / "audit.head"
    if head.is_file() and not head.is_symlink():
        fd = os.open(head, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            acl.set_append_only(fd, False, shown=str(head))
        finally:
            os.close(fd)
    shutil.rmtree(team, ignore_errors=True)
