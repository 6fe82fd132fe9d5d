"""The team folder and run root a policy needs, and the modes inside them.

    TEAM/                 the team folder: group = viewer, mode 2750 (others cannot enter)
    TEAM/access.yaml      the policy it was prepared with (what `dtk.access show` prints)
    TEAM/runs/            the run root (run.root): group = maintainer, mode 3775, and an ACL
                          entry that lets the submitter group write it (setgid, sticky)
    TEAM/runs/audit/      the audit log (dtk.common.audit): group = viewer, mode 3770, one file per entry
    TEAM/runs/audit.head  each entry's number and hash: group = viewer, 0660, append-only (chattr +a)
    TEAM/data/            datasets: group = maintainer, mode 2775

Why two levels: one Unix group per directory gives three classes (owner, group, others),
and a run needs four (its user, maintainers who write, viewers who read, outsiders who do
not). The team folder keeps outsiders out, so inside it "others" means the team: a run
directory (setgid: group = maintainer) created under umask 002 is writable by its user and
the maintainers and readable by every viewer. Only the roles that start runs (submitters,
through the ACL entry) and the maintainers may create entries in the run root, so a viewer
can neither take a run's name nor rename one; the sticky bit keeps one user's run from
being renamed or removed by another. Every role holder is therefore a viewer too.

`prepare` runs as root inside folders that members can write, so it follows no link: each
folder is opened with O_NOFOLLOW relative to its parent's descriptor, and changed through
that descriptor (fchown, fchmod); a link or a non-folder where a folder belongs is refused.
"""

from __future__ import annotations

import errno
import grp
import os
import stat
from pathlib import Path

from dtk.access import acl
from dtk.common.errors import UserError
from dtk.config.access import AccessConfig

UMASK = 0o002  # group-writable files and folders inside the run root (the group is the maintainers')
TEAM_MODE = 0o2750
ROOT_MODE = 0o3775
AUDIT_MODE = 0o3770
HEAD_MODE = 0o660
DATA_MODE = 0o2775
POLICY_FILE = "access.yaml"
RUNS, DATA = "runs", "data"
AUDIT_DIR, AUDIT_HEAD, OLD_AUDIT = "audit", "audit.head", "audit.jsonl"


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


def _refuse_link(shown: Path, st: os.stat_result, kind: str) -> None:
    """A link or the wrong kind of file where prepare expects `kind` ("folder" or "file")."""
    if stat.S_ISLNK(st.st_mode):
        raise UserError(f"{shown} is a symbolic link (-> {os.readlink(shown)}); dtk.access prepare follows no link:"
                        f" remove it (rm {shown}) and run prepare again")
    wanted = stat.S_ISDIR if kind == "folder" else stat.S_ISREG
    if not wanted(st.st_mode):
        raise UserError(f"{shown} is not a {kind} ({stat.filemode(st.st_mode)}); dtk.access prepare expects a {kind}"
                        f" there: move it away and run prepare again")
    if kind == "file" and st.st_nlink != 1:
        raise UserError(f"{shown} has {st.st_nlink} hard links; dtk.access prepare changes only a file of its own:"
                        f" remove it and run prepare again")


def _lstat(parent_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _open(parent_fd: int, name: str, shown: Path, kind: str, *, create: bool) -> int:
    """A descriptor of `name` in the folder `parent_fd`, never through a link; created
    (empty, private) when missing and `create`."""
    st = _lstat(parent_fd, name)
    if st is None and create:
        try:
            if kind == "folder":
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            else:
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=parent_fd))
        except FileExistsError:
            pass
        st = _lstat(parent_fd, name)
    assert st is not None, f"{shown} vanished while prepare made it"
    _refuse_link(shown, st, kind)
    flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if kind == "folder" else os.O_NONBLOCK)
    try:
        fd = os.open(name, flags, dir_fd=parent_fd)
    except OSError as exc:  # replaced by a link or another kind of file since the check
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            _refuse_link(shown, os.stat(name, dir_fd=parent_fd, follow_symlinks=False), kind)
        raise
    _refuse_link(shown, os.fstat(fd), kind)  # what was opened is what was checked
    return fd


def _set(fd: int, shown: Path, group: str, mode: int) -> None:
    try:
        os.fchown(fd, -1, _gid(group))
        os.fchmod(fd, mode)
    except PermissionError:
        raise UserError(f"cannot give {shown} group {group} and mode {mode:o}: run this as root, or as its owner"
                        f" and a member of {group}") from None


def _check_existing(team: Path) -> None:
    """Every path prepare will change is refused before anything changes, if it is a link."""
    expected = [(team, "folder"), (team / RUNS, "folder"), (team / DATA, "folder"),
                (team / RUNS / AUDIT_DIR, "folder"), (team / RUNS / AUDIT_HEAD, "file"),
                (team / RUNS / OLD_AUDIT, "file"), (team / POLICY_FILE, "file")]
    for path, kind in expected:
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        _refuse_link(path, st, kind)


def prepare(team: Path, policy: AccessConfig, policy_text: str) -> list[str]:
    """Create (or repair) the team folder, run root, audit log and data folder; returns
    what was set. `team` itself is not followed either (its parent is the admin's choice)."""
    assert policy.submitter.group and policy.viewer.group and policy.maintainer.group
    team = team.parent.resolve() / team.name
    _check_existing(team)
    team.parent.mkdir(parents=True, exist_ok=True)
    fds: list[int] = [os.open(team.parent, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        team_fd = _open(fds[0], team.name, team, "folder", create=True)
        fds.append(team_fd)
        _set(team_fd, team, policy.viewer.group, TEAM_MODE)
        runs_fd = _open(team_fd, RUNS, team / RUNS, "folder", create=True)
        fds.append(runs_fd)
        _set(runs_fd, team / RUNS, policy.maintainer.group, ROOT_MODE)
        acl.grant_group(runs_fd, mode=ROOT_MODE, gid=_gid(policy.submitter.group), perm=0o7, shown=str(team / RUNS))
        data_fd = _open(team_fd, DATA, team / DATA, "folder", create=True)
        fds.append(data_fd)
        _set(data_fd, team / DATA, policy.maintainer.group, DATA_MODE)
        audit_fd = _open(runs_fd, AUDIT_DIR, team / RUNS / AUDIT_DIR, "folder", create=True)
        fds.append(audit_fd)
        _set(audit_fd, team / RUNS / AUDIT_DIR, policy.viewer.group, AUDIT_MODE)
        head_fd = _open(runs_fd, AUDIT_HEAD, team / RUNS / AUDIT_HEAD, "file", create=True)
        fds.append(head_fd)
        acl.set_append_only(head_fd, False, shown=str(team / RUNS / AUDIT_HEAD))  # owner and mode may change
        os.fchown(head_fd, 0, _gid(policy.viewer.group))
        os.fchmod(head_fd, HEAD_MODE)
        acl.set_append_only(head_fd, True, shown=str(team / RUNS / AUDIT_HEAD))
        if _lstat(runs_fd, OLD_AUDIT) is not None:  # an unchained log of an older dtk: kept, read-only
            old_fd = _open(runs_fd, OLD_AUDIT, team / RUNS / OLD_AUDIT, "file", create=False)
            fds.append(old_fd)
            try:
                os.fchmod(old_fd, 0o444)
            except PermissionError:  # already append-only or immutable (chattr): left as it is
                pass
        _write_policy(team_fd, policy_text)
    finally:
        for fd in reversed(fds):
            os.close(fd)
    shown = [team, team / POLICY_FILE, team / RUNS, team / RUNS / AUDIT_DIR, team / RUNS / AUDIT_HEAD, team / DATA]
    return [describe(p) for p in shown]


def _write_policy(team_fd: int, text: str) -> None:
    """TEAM/access.yaml, written as a new file and renamed over the old one (a link there
    is replaced, not followed)."""
    tmp = f".{POLICY_FILE}.tmp"
    try:
        os.unlink(tmp, dir_fd=team_fd)  # a leftover of a killed prepare, or a planted link: the link itself goes
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=team_fd)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)
    os.replace(tmp, POLICY_FILE, src_dir_fd=team_fd, dst_dir_fd=team_fd)


def describe(path: Path) -> str:
    st = os.lstat(path)
    return f"{stat.filemode(st.st_mode)}  {_group_name(st.st_gid):<12}  {path}"


def find_team(path: Path) -> Path | None:
    """The nearest folder at or above `path` that holds an access.yaml (a prepared team
    folder), or one this user cannot look into (a gate whose checks follow); None when
    there is none up to the file system's root."""
    path = Path(os.path.abspath(path))
    gate = None  # the shallowest folder seen so far that this user cannot search
    for folder in (path, *path.parents):
        try:
            st = os.stat(folder / POLICY_FILE)
        except PermissionError:
            gate = folder
            continue
        except (FileNotFoundError, NotADirectoryError):
            if gate is not None:
                return gate
            continue
        if stat.S_ISREG(st.st_mode):
            return gate or folder
    return gate


def check_in_team(run_root: Path) -> Path | None:
    """The team folder governing `run_root`, which must then be that folder's run root:
    a run root deeper inside (or beside) it would escape the policy's checks, umask and
    audit log. None: no team folder above it."""
    run_root = Path(os.path.abspath(run_root))
    team = find_team(run_root)
    if team is None:
        return None
    recorded = recorded_policy(team / RUNS)
    if recorded is None and run_root != team / RUNS:
        return None  # a folder this user cannot look into, not known to be a team's: its modes speak
    if run_root != team / RUNS:
        raise UserError(f"run.root={run_root} is inside the team folder {team}, prepared for access policy"
                        f" {recorded}; its run root is {team / RUNS}:"
                        f" set run.root={team / RUNS}")
    return team


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
    if (_group_name(root_st.st_gid) != policy.maintainer.group or not root_st.st_mode & stat.S_ISGID
            or root_st.st_mode & 0o002):
        problems.append(f"{run_root} has group {_group_name(root_st.st_gid)} and mode"
                        f" {stat.filemode(root_st.st_mode)}, expected group {policy.maintainer.group}, setgid,"
                        " not writable by others")
    if not (run_root / AUDIT_DIR).is_dir():
        problems.append(f"{run_root} has no audit folder {AUDIT_DIR}/")
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
