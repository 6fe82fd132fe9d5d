"""Roles and what enforces them: dtk checks first and explains, Unix groups and modes guard
the run root, Slurm's partitions refuse an outsider who bypasses dtk (docs/access.md).

Stdlib (and omegaconf to read a policy file) only: this runs on the login node.
May import config (the policy's schema) only. text.py shows a policy (python -m dtk.access show, the handover's access.md).
"""
