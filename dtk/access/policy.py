"""Reading an access policy, and who holds its roles, from the group database.

Membership comes from the group database (`getent group`), not from the groups of the
running process: a user removed from a group loses the role at dtk's next check, even in
a login session that still carries the old groups.
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass
from pathlib import Path

from dtk.common.errors import UserError
from dtk.config.access import AccessConfig

ROLES = ("submitter", "viewer", "maintainer")
ROLE_MAY = {
    "submitter": "start, stop and requeue training",
    "viewer": "read metrics, events and reports",
    "maintainer": "change configs and datasets and delete checkpoints",
}


def policy_file(name_or_path: str) -> Path:
    """A YAML file, or access/NAME.yaml in the user's config folders (first) or dtk's conf/."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    from dtk.config.compose import config_dir, search_path

    folders = [*search_path().config, config_dir()]
    for folder in folders:
        if (folder / "access" / f"{name_or_path}.yaml").is_file():
            return folder / "access" / f"{name_or_path}.yaml"
    known = sorted({p.stem for folder in folders for p in (folder / "access").glob("*.yaml")})
    raise UserError(f"access policy {name_or_path}: no such file, and no access/{name_or_path}.yaml in"
                    f" {', '.join(str(f) for f in folders)} (policies: {', '.join(known) or 'none'})")


def load_policy(name_or_path: str) -> AccessConfig:
    """A policy from a YAML file, or by name from the config folders' access/ group."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = policy_file(name_or_path)
    try:
        raw = OmegaConf.load(path)
        if isinstance(raw, DictConfig) and "defaults" in raw:
            del raw["defaults"]
        merged = OmegaConf.merge(OmegaConf.structured(AccessConfig), raw)
        policy = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise UserError(f"access policy {path}: {str(exc).splitlines()[0]}") from None
    assert isinstance(policy, AccessConfig)
    check_policy(policy, where=str(path))
    return policy


def check_policy(policy: AccessConfig, *, where: str) -> None:
    """A policy either names a group for every role or for none (`open`)."""
    named = [role for role in ROLES if getattr(policy, role).group]
    if named and len(named) != len(ROLES):
        missing = [role for role in ROLES if role not in named]
        raise UserError(f"access policy {where}: {', '.join(f'{r}.group' for r in missing)} unset; a policy names"
                        " the group of every role (submitter, viewer, maintainer) or of none")


def enforced(policy: AccessConfig) -> bool:
    return bool(policy.submitter.group)


@dataclass(frozen=True)
class User:
    uid: int
    name: str

    @staticmethod
    def current() -> User:
        uid = os.getuid()
        try:
            return User(uid, pwd.getpwuid(uid).pw_name)
        except KeyError:
            return User(uid, str(uid))


def group_members(group: str) -> set[str]:
    """User names in `group`: its listed members and the users whose primary group it is."""
    try:
        entry = grp.getgrnam(group)
    except KeyError:
        raise UserError(f"group {group} does not exist on this machine; an administrator creates it"
                        f" (groupadd {group}) or the access policy names another") from None
    primary = {p.pw_name for p in pwd.getpwall() if p.pw_gid == entry.gr_gid}
    return set(entry.gr_mem) | primary


def holds(user: User, policy: AccessConfig, role: str) -> bool:
    """True when `user` holds `role` (always, for a role the policy does not enforce)."""
    group = getattr(policy, role).group
    return group is None or user.name in group_members(group)


def how_to_join(user: User, group: str, role: str) -> str:
    """Only the submitter role is also Slurm's to check (the partitions' AllowGroups)."""
    said = f"ask an administrator to add you (gpasswd -a {user.name} {group}); dtk sees the change at once"
    return said + (", Slurm's partitions at their next group update" if role == "submitter" else "")


def roles_of(user: User, policy: AccessConfig) -> list[str]:
    """The roles `user` holds under an enforced policy, from the group database."""
    return [role for role in ROLES if holds(user, policy, role)]


def require_role(user: User, policy: AccessConfig, role: str, *, doing: str) -> None:
    """The check dtk makes before it acts: one error line naming the group and how to join."""
    if holds(user, policy, role):
        return
    group = getattr(policy, role).group
    raise UserError(f"user {user.name} may not {doing}: not in group {group}, the {role} role of access policy"
                    f" {policy.name} (its members may {ROLE_MAY[role]}); {how_to_join(user, group, role)}")
