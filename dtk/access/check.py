"""The checks dtk makes before it acts under an access policy. Each refusal is one error
line that names the group (or key) and how to get it; the systems that own the resource
(Slurm's partitions, the run root's groups and modes) refuse anyway when dtk is bypassed."""

from __future__ import annotations

import os
from pathlib import Path

from dtk.access import layout
from dtk.access.policy import ROLES, User, enforced, load_policy, require_role, roles_of
from dtk.common.errors import UserError
from dtk.config.access import AccessConfig

SLURM_KEYS = ("partition", "account", "qos")


def check_submit(policy: AccessConfig, *, run_dir: Path, cluster_kind: str, partition: str | None,
                 account: str | None, qos: str | None, user: User | None = None) -> None:
    """Before anything is written or sbatch is called: the role, the Slurm keys the role
    fixes, the run root, the run directory's owner."""
    user = user or User.current()
    run_root = run_dir.parent
    team = layout.find_team(run_root)
    recorded = layout.recorded_policy(team / layout.RUNS) if team is not None else None
    if team is not None and recorded is not None and recorded != policy.name:
        raise UserError(f"access={policy.name}: run.root={run_root} is governed by access policy {recorded}"
                        f" ({team / layout.POLICY_FILE}); submit with access={recorded}")
    if recorded is not None:
        layout.check_in_team(run_root)
    if not enforced(policy):
        return
    require_role(user, policy, "submitter", doing="submit training")
    require_role(user, policy, "viewer", doing="submit training (every role holder is a viewer too)")
    if cluster_kind == "slurm":
        given = {"partition": partition, "account": account, "qos": qos}
        for key in SLURM_KEYS:
            wanted = getattr(policy.submitter, key)
            if wanted is not None and given[key] != wanted:
                raise UserError(f"cluster.{key}={given[key]}: access policy {policy.name} has submitters use"
                                f" {key} {wanted}; set cluster.{key}={wanted}")
    layout.check_run_root(run_root, policy)
    layout.check_run_dir(run_dir, user.uid, user.name)


def policy_of_run(run_dir: Path) -> AccessConfig | None:
    """The policy of the nearest prepared team folder above the run (whose run root it must
    be in); None where there is none."""
    team = layout.check_in_team(Path(run_dir).resolve().parent)
    if team is None:
        return None
    try:
        return load_policy(str(team / layout.POLICY_FILE))
    except PermissionError as exc:
        raise UserError(f"{run_dir}: you cannot read {exc.filename or team / layout.POLICY_FILE}; every role holder"
                        f" of the access policy of {team} is in its group (python -m dtk.access show POLICY says who"
                        " holds which)") from None


def check_action(run_dir: Path, role: str, *, doing: str) -> None:
    """For commands on an existing run (drill, stop, checkpoint delete): the role first."""
    policy = policy_of_run(run_dir)
    if policy is not None and enforced(policy):
        require_role(User.current(), policy, role, doing=doing)


def apply_umask(policy: AccessConfig) -> None:
    """Group-writable files from here on, for this process and what it starts: sbatch
    passes the umask to the job (SLURM_UMASK), the local driver to its workers."""
    if enforced(policy):
        os.umask(layout.UMASK)


def user_groups(name: str) -> set[str]:
    """The groups of user `name` in the group database (what Slurm's AllowGroups reads)."""
    import grp
    import pwd

    try:
        primary = {grp.getgrgid(pwd.getpwnam(name).pw_gid).gr_name}
    except KeyError:
        primary = set()
    return primary | {g.gr_name for g in grp.getgrall() if name in g.gr_mem}


def check_admitted(parts: list, *, partition: str | None, policy: AccessConfig, user: User | None = None) -> None:
    """A partition this user is not admitted to (AllowGroups) is named as such, with the
    partitions and roles the user has, instead of "no such partition" (Slurm hides it)."""
    user = user or User.current()
    if user.uid == 0:  # root and SlurmUser are not subject to AllowGroups
        return
    chosen = next((p for p in parts if (p.name == partition if partition else p.default)), None)
    if chosen is None or chosen.allow_groups is None:
        return
    groups = user_groups(user.name)
    if groups & set(chosen.allow_groups):
        return
    admitted = [p.name for p in parts if p.allow_groups is None or groups & set(p.allow_groups)]
    held = ""
    if enforced(policy):
        roles = roles_of(user, policy)
        held = (f"; under access policy {policy.name} you hold {', '.join(roles) if roles else 'no role'}"
                f" ({', '.join(f'{r}: group {getattr(policy, r).group}' for r in ROLES)})")
    raise UserError(f"cluster.partition={chosen.name}: user {user.name} is not admitted to partition {chosen.name}"
                    f" (it admits groups {', '.join(chosen.allow_groups)}; you are in {', '.join(sorted(groups)) or 'none'}"
                    f"{held}); partitions you may use: {', '.join(admitted) or 'none'}. Ask an administrator to add"
                    f" you to {chosen.allow_groups[0]} (gpasswd -a {user.name} {chosen.allow_groups[0]})")


def explain_denied(filename: str | None) -> str:
    """What a refused read or write means under the policy of the team folder above
    `filename`: the roles this user holds and the one the act takes."""
    generic = ("under an access policy, reading runs takes the viewer role and changing them the run's user or the"
               " maintainer role (python -m dtk.access show POLICY says who holds which)")
    if not filename:
        return generic
    team = layout.find_team(Path(filename).parent)
    if team is None:
        return "the file's owner, group and mode do not let you (ls -l shows them)"
    try:
        policy = load_policy(str(team / layout.POLICY_FILE))
    except (UserError, OSError):
        try:
            group = layout._group_name(os.stat(team).st_gid)
        except OSError:
            group = "see ls -ld"
        return (f"you cannot enter {team} (group {group}); under an access policy, every role holder is in the"
                " team folder's group (python -m dtk.access show POLICY says who holds which)")
    roles = roles_of(User.current(), policy)
    return (f"under access policy {policy.name} you hold {', '.join(roles) if roles else 'no role'}; reading runs"
            f" takes the viewer role (group {policy.viewer.group}), changing them the run's user or the maintainer"
            f" role (group {policy.maintainer.group})")
