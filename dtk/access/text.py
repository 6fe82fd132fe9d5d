"""An access policy as text: its roles, what each may do, the groups that hold them and their
members today (`python -m dtk.access show`, the handover's access.md)."""

from __future__ import annotations

from dtk.access.policy import ROLE_MAY, ROLES, enforced, group_members
from dtk.common.errors import UserError
from dtk.config.access import AccessConfig


def render(policy: AccessConfig) -> str:
    """The policy as a team reads it: who holds each role today and what it may do."""
    lines = [f"access policy {policy.name}"]
    if not enforced(policy):
        return lines[0] + ": open (no group is checked; run directories keep each user's umask)"
    for role in ROLES:
        group = getattr(policy, role).group
        try:
            members = ", ".join(sorted(group_members(group))) or "nobody"
        except UserError:
            members = "(the group does not exist on this machine)"
        lines.append(f"  {role:<10}  group {group:<14}  may {ROLE_MAY[role]}")
        lines.append(f"  {'':<10}  members: {members}")
    slurm = [f"{key} {getattr(policy.submitter, key)}" for key in ("partition", "account", "qos")
             if getattr(policy.submitter, key)]
    if slurm:
        lines.append(f"  submitters' jobs: {', '.join(slurm)}")
    return "\n".join(lines)
