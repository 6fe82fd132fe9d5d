"""Schema of an access policy (group `access`): three roles, each a Unix group.

    submitter   may start, stop and requeue training (and drill it)
    viewer      may read metrics, events and reports of every run
    maintainer  may change configs and datasets, and delete checkpoints

The policy's files are conf/access/NAME.yaml (and access/NAME.yaml in a user's own config
folder); `access=NAME` picks one. The default, `open`, names no group: nothing is checked
and run directories keep the modes of the user's umask. docs/access.md explains the
layout a policy gives the run root and what enforces each role.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoleConfig:
    group: str | None = None
    """Unix group whose members hold the role. None: the role is not enforced."""


@dataclass
class SubmitterConfig(RoleConfig):
    account: str | None = None
    """Slurm account the role's jobs are charged to; cluster.account must name it. The lab's partitions allow only this account (AllowAccounts, with accounting)."""
    qos: str | None = None
    """Slurm QOS the role's jobs run under; cluster.qos must name it. None: any."""
    partition: str | None = None
    """Slurm partition the role submits to; cluster.partition must name it. None: any."""


@dataclass
class AccessConfig:
    """Who may start training, see metrics and change configs (docs/access.md)."""

    name: str = "open"
    """Name of the policy (its file is conf/access/NAME.yaml)."""
    submitter: SubmitterConfig = field(default_factory=SubmitterConfig)
    """May start, stop and requeue training; its members' jobs are the only ones the cluster's partitions accept."""
    viewer: RoleConfig = field(default_factory=RoleConfig)
    """May read metrics, events and reports. Every holder of another role must be a member too: the group opens the team folder that holds the run root."""
    maintainer: RoleConfig = field(default_factory=RoleConfig)
    """May change configs and datasets and delete checkpoints: the group that owns run directories, with write access."""
