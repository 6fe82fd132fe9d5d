"""The lab cluster for tests: bring it up, or skip with the reason (fail under CI=true,
through conftest.require).

conftest.py wires these into a session fixture; a test module that changes the lab (as
tests/test_lab.py does) restores it afterwards with the same two functions.
"""

from __future__ import annotations

import os

from dtk import lab


def unavailable_reason() -> str | None:
    """Why the lab cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "the Slurm lab needs root: it starts munged, slurmctld and slurmd"
    missing = lab.missing_programs()
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge"
    return None


def ensure_lab(nodes: int = 3) -> lab.LabStatus:
    """The lab up with `nodes` idle nodes: a no-op when it already is, a restart when it
    runs another node count. Never installs packages from a test."""
    # Imported here, not at the top: conftest imports this module.
    from conftest import require

    reason = unavailable_reason()
    require(reason is None, f"the Slurm lab cannot run here: {reason}")
    return lab.up(nodes, install=False, log=lambda _line: None)


def lab_down() -> None:
    """Stop the lab if it is up; nothing to do on a machine that cannot run it."""
    if unavailable_reason() is None and lab.status().record is not None:
        lab.down(log=lambda _line: None)
