"""A real Slurm cluster on this machine, for trying dtk and for the test suite.

    python -m dtk.lab up --nodes 3     # as root
    python -m dtk.lab status
    python -m dtk.lab down

Stdlib and psutil only: this runs on a login node, where torch is not imported.
"""

from dtk.lab.cluster import (
    LabError,
    LabRecord,
    LabStatus,
    down,
    lab_dir,
    missing_programs,
    status,
    up,
)

__all__ = ["LabError", "LabRecord", "LabStatus", "down", "lab_dir", "missing_programs", "status", "up"]
