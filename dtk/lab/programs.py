"""The programs the lab runs: finding them, installing them, and asking its Slurm."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

from dtk.common.errors import UserError
from dtk.lab.files import SystemFiles

PACKAGES = ("slurm-wlm", "munge")
PROGRAMS = ("munged", "munge", "slurmctld", "slurmd", "sinfo", "srun", "sbatch", "squeue", "scontrol")

Log = Callable[[str], None]


class LabError(UserError):
    """Something on this machine stops the lab; the message says what to do about it."""


def find_program(name: str) -> str | None:
    # A user's PATH often lacks /usr/sbin, where Debian puts the daemons.
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if find_program(name) is None]


def program(name: str) -> str:
    path = find_program(name)
    if path is None:
        raise LabError(f"{name} not found; install slurm-wlm and munge (python -m dtk.lab up does it as root)")
    return path


def slurm(argv: list[str], system: SystemFiles) -> subprocess.CompletedProcess:
    """Run a Slurm command against the lab's config, whatever the caller's SLURM_CONF."""
    env = {**os.environ, "SLURM_CONF": str(system.slurm_conf)}
    return subprocess.run([program(argv[0]), *argv[1:]], capture_output=True, text=True,
                          env=env, timeout=30, check=False)


def munge_works() -> bool:
    return subprocess.run([program("munge"), "-n"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, check=False).returncode == 0


def ensure_installed(install: bool, log: Log) -> None:
    """Install slurm-wlm and munge with apt-get when a program is missing. Called only
    once the machine has been found to have no Slurm of its own."""
    missing = missing_programs()
    if not missing:
        return
    if not install:
        raise LabError(f"{', '.join(missing)} not found and --no-install was given; "
                       "install them with: apt-get install slurm-wlm munge")
    if shutil.which("apt-get") is None:
        raise LabError(f"{', '.join(missing)} not found and there is no apt-get; "
                       "install Slurm and munge, then run this again")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install_cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    log(f"installing {' '.join(PACKAGES)} with apt-get")
    if subprocess.run(install_cmd, env=env, check=False).returncode != 0:
        # A fresh image has no package lists yet.
        subprocess.run(["apt-get", "update"], env=env, check=False)
        if subprocess.run(install_cmd, env=env, check=False).returncode != 0:
            raise LabError("apt-get could not install slurm-wlm and munge; see its output above")
    if missing_programs():
        raise LabError(f"still missing after apt-get: {', '.join(missing_programs())}")


def require_root(command: str) -> None:
    if os.geteuid() != 0:
        raise LabError(f"`python -m dtk.lab {command}` must run as root: it starts and stops munged and the "
                       f"Slurm daemons (try: sudo .venv/bin/python -m dtk.lab {command}, with dtk's own python)")
