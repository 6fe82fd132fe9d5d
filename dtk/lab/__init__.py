"""A real Slurm cluster on this machine, for trying dtk and for the test suite.

    python -m dtk.lab up --nodes 3 [--netns]     # as root
    python -m dtk.lab slow NODE RATE             # with --netns: limit what NODE sends
    python -m dtk.lab status
    python -m dtk.lab down [--force]

Stdlib and psutil only: this runs on a login node, where torch is not imported.
May import config and access (a policy put in force on the lab).
"""

from dtk.lab.cluster import LabStatus, down, lab_dir, slow, status, up
from dtk.lab.jobs import LabJob
from dtk.lab.programs import LabError, missing_programs
from dtk.lab.record import LabRecord

__all__ = ["LabError", "LabJob", "LabRecord", "LabStatus", "down", "lab_dir", "missing_programs", "slow", "status",
           "up"]
