"""A real Slurm cluster on this machine, for trying dtk and for the test suite.

    python -m dtk.lab up --nodes 3     # as root
    python -m dtk.lab status
    python -m dtk.lab down [--force]

Stdlib and psutil only: this runs on a login node, where torch is not imported.
"""

from dtk.lab.cluster import LabStatus, down, lab_dir, status, up
from dtk.lab.jobs import LabJob
from dtk.lab.programs import LabError, missing_programs
from dtk.lab.record import LabRecord

__all__ = ["LabError", "LabJob", "LabRecord", "LabStatus", "down", "lab_dir", "missing_programs", "status", "up"]
