"""The team folder and run root a policy needs, and the modes inside them.

    TEAM/                 the team folder: group = viewer, mode 2750 (others cannot enter)
    TEAM/access.yaml      the policy it was prepared with (what `dtk.access show` prints)
    TEAM/runs/            the run root (run.root): group = maintainer, mode 3777 (setgid, sticky)
    TEAM/runs/audit.jsonl who did what (dtk.audit), appendable by every role holder
    TEAM/data/            datasets: group = maintainer, mode 2775

Why two levels: one Unix group per directory gives three classes (owner, group, others),
and a run needs four (its user, maintainers who write, viewers who read, outsiders who do
not). The team folder keeps outsiders out, so inside it "others" means the team: a run
directory (setgid: group = maintainer) created under umask 002 is writable by its user and
the maintainers and readable by every viewer. The sticky bit keeps one user's run from
being renamed or removed by another. Every role holder is therefore a viewer too.
"""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

from dtk.config.access import AccessConfig
from dtk.errors import UserError

UMASK = 0o002  # group-writable files and folders inside the run root (the group is the maintainers')
TEAM_MODE = 0o2750
ROOT_MODE = 0o3777
DATA_MODE = 0o2775
POLICY_FILE = "access.yaml"
RUNS, DATA = "runs", "data"


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _gid(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise UserError(f"group {group} does not exist on this machine (groupadd {group})") from None


def _set(path: Path, group: str, mode: int) -> None:
    try:
        os.chown(path, -1, _gid(group))
        os.chmod(path, mode)
    except PermissionError:
        raise UserError(f"cannot give {path} group {group} and mode {mode:o}: run this as root, or as its owner"
                        f" and a member of {group}") from None


def prepare(team: Path, policy: AccessConfig, policy_text: str) -> list[str]:
    """Create (or repair) the team folder, run root and data folder; returns what was set."""
    assert policy.submitter.group and policy.viewer.group and policy.maintainer.group
    runs, data = team / RUNS, team / DATA
    for folder in (team, runs, data):
        folder.mkdir(parents=True, exist_ok=True)
    _set(team, policy.viewer.group, TEAM_MODE)
    _set(runs, policy.maintainer.group, ROOT_MODE)
    _set(data, policy.maintainer.group, DATA_MODE)
    tmp = team / f".{POLICY_FILE}.tmp"
    tmp.write_text(policy_text)
    tmp.chmod(0o644)
    tmp.replace(team / POLICY_FILE)
    log = runs / "audit.jsonl"
    log.touch()
    _set(log, policy.maintainer.group, 0o666)
    return [describe(p) for p in (team, team / POLICY_FILE, runs, log, data)]


def describe(path: Path) -> str:
    st = path.stat()
    return f"{stat.filemode(st.st_mode)}  {_group_name(st.st_gid):<12}  {path}"


def recorded_policy(run_root: Path) -> str | None:
    """The name of the policy the run root's team folder was prepared with, if readable."""
    try:
        text = (run_root.parent / POLICY_FILE).read_text()
    except OSError:
        return None
    from omegaconf import DictConfig, OmegaConf

    recorded = OmegaConf.create(text)
    return str(recorded.get("name")) if isinstance(recorded, DictConfig) else None


def check_run_root(run_root: Path, policy: AccessConfig) -> None:
    """The run root is a prepared one of this policy, or an error says how to make it so."""
    team = run_root.parent
    fix = f"an administrator prepares it: python -m dtk.access prepare {team} --policy {policy.name}"
    try:
        team_st, root_st = team.stat(), run_root.stat()
    except FileNotFoundError:
        raise UserError(f"run.root={run_root} does not exist; access policy {policy.name} needs a prepared run root"
                        f" ({fix}, then run.root={team / RUNS})") from None
    except PermissionError:
        raise UserError(f"run.root={run_root}: you cannot enter {team} (group {_group_name(team.stat().st_gid)});"
                        f" every role holder of access policy {policy.name} is in group {policy.viewer.group}") from None
    problems = []
    if _group_name(team_st.st_gid) != policy.viewer.group or team_st.st_mode & 0o007:
        problems.append(f"{team} has group {_group_name(team_st.st_gid)} and mode {stat.filemode(team_st.st_mode)},"
                        f" expected group {policy.viewer.group} and no access for others")
    if _group_name(root_st.st_gid) != policy.maintainer.group or not root_st.st_mode & stat.S_ISGID:
        problems.append(f"{run_root} has group {_group_name(root_st.st_gid)} and mode"
                        f" {stat.filemode(root_st.st_mode)}, expected group {policy.maintainer.group}, setgid")
    if problems:
        raise UserError(f"run.root={run_root} is not prepared for access policy {policy.name}: {problems[0]}; {fix}")


def check_run_dir(run_dir: Path, uid: int, name: str) -> None:
    """A run is continued by the user who started it: its files are that user's."""
    try:
        owner = run_dir.stat().st_uid
    except FileNotFoundError:
        return
    if owner != uid:
        import pwd

        try:
            who = pwd.getpwuid(owner).pw_name
        except KeyError:
            who = str(owner)
        raise UserError(f"run {run_dir} was started by user {who}; a run is continued by the user who started it"
                        f" (its files are theirs): ask {who}, or choose another run.name (user {name})")


def write_readonly(path: Path, text: str) -> None:
    """Write a file that nobody edits in place (the resolved config once submitted): a new
    file renamed over the old one, mode 0444. Unchanged content is left alone."""
    try:
        if path.read_text() == text:
            return
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)
