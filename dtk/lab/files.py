"""The files the lab renders and the system files it shares with the rest of the machine.

Rendering is pure (a function of the lab layout and the node count); the writers touch
/etc only where the file is absent or was written by dtk, so a machine with its own Slurm
is never reconfigured behind its owner's back.
"""

from __future__ import annotations

import errno
import os
import pwd
import string
from dataclasses import dataclass
from pathlib import Path

from dtk.common.resources import templates_dir
from dtk.lab.gres import node_shape

TEMPLATE = templates_dir() / "slurm.conf.tmpl"

# The first line of every file dtk.lab writes under /etc; its presence is what makes the
# file ours to overwrite.
CONF_HEADER = "# Written by dtk.lab (python -m dtk.lab up): dtk may overwrite it. See docs/lab.md."
HOSTS_MARK = "# dtk-lab"

FIRST_NODE_PORT = 17001
CPUS_PER_NODE = 2
REAL_MEMORY_MB = 2048
GRACE_TIME_S = 15
PREEMPT_MODES = {"requeue": "REQUEUE", "cancel": "CANCEL"}
"""`dtk.lab up --preempt-mode` -> slurm.conf's PreemptMode."""


@dataclass(frozen=True)
class SystemFiles:
    """The machine's files that the lab reads or writes, outside its own directory."""

    etc: Path = Path("/etc")

    @property
    def slurm_conf(self) -> Path:
        """Where every Slurm command looks for its config when SLURM_CONF is unset."""
        return self.etc / "slurm" / "slurm.conf"

    @property
    def gres_conf(self) -> Path:
        """Slurm reads gres.conf from the folder of slurm.conf."""
        return self.etc / "slurm" / "gres.conf"

    @property
    def hosts(self) -> Path:
        return self.etc / "hosts"

    @property
    def munge_key(self) -> Path:
        return self.etc / "munge" / "munge.key"

    @property
    def resolv_conf(self) -> Path:
        """The name servers a configless Slurm client would ask for its controller."""
        return self.etc / "resolv.conf"


def system_files() -> SystemFiles:
    """/etc, or $DTK_LAB_ETC: a stand-in folder for dtk's own tests, which check what `up`
    does on a machine with a foreign Slurm without touching this machine's /etc."""
    return SystemFiles(Path(os.environ.get("DTK_LAB_ETC") or "/etc"))


@dataclass(frozen=True)
class LabLayout:
    """Where one lab keeps everything it owns: one directory, default /var/lib/dtk-lab."""

    root: Path

    @property
    def conf(self) -> Path:
        """The rendered slurm.conf, kept next to the state it describes."""
        return self.root / "slurm.conf"

    @property
    def record(self) -> Path:
        """JSON record of the running lab: node count and every daemon it started."""
        return self.root / "lab.json"

    @property
    def access_state(self) -> Path:
        """The access policy in force (dtk.lab.access); absent while the partitions are open."""
        return self.root / "access.json"

    @property
    def marker(self) -> Path:
        """Proof that the directory is a lab directory, so `up` may wipe its subfolders."""
        return self.root / ".dtk-lab"

    @property
    def lock(self) -> Path:
        return self.root / "lock"

    @property
    def session(self) -> Path:
        """Who is using the lab (dtk.lab.session): `up` records it, `down` ends it."""
        return self.root / "session.json"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def spool_dir(self) -> Path:
        return self.root / "spool"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def pid_dir(self) -> Path:
        return self.root / "pids"

    @property
    def munge_dir(self) -> Path:
        """munged's own pid, log and seed files; owned by user munge, which it insists on."""
        return self.root / "munge"

    def fresh_dirs(self) -> tuple[Path, ...]:
        """Folders `up` empties, so that each lab starts with no jobs and no node history."""
        return (self.state_dir, self.spool_dir, self.log_dir, self.pid_dir)


def node_name(index: int) -> str:
    return f"node{index}"


def node_names(num_nodes: int) -> list[str]:
    return [node_name(k) for k in range(1, num_nodes + 1)]


def node_port(index: int) -> int:
    """Each slurmd listens on its own port, since all of them share 127.0.0.1."""
    return FIRST_NODE_PORT + index - 1


def node_lines(num_nodes: int, addresses: list[str] | None = None, gpus_per_node: int = 0) -> str:
    """slurm.conf's NodeName lines: one for all nodes on 127.0.0.1, or, given each node's
    address (the lab with --netns), one per node; with GPUs, two sockets and `Gres=gpu:G`
    (dtk.lab.gres)."""
    rest = f"{node_shape(gpus_per_node, CPUS_PER_NODE).resources(CPUS_PER_NODE)} RealMemory={REAL_MEMORY_MB} State=UNKNOWN"
    if addresses is not None:
        return "\n".join(f"NodeName={node_name(k)} NodeHostname=localhost NodeAddr={addr} Port={node_port(k)} {rest}"
                         for k, addr in enumerate(addresses, start=1))
    # A one-node range ("node[1-1]", "17001-17001") is legal but reads oddly in sinfo.
    names = node_range(num_nodes)
    ports = str(FIRST_NODE_PORT) if num_nodes == 1 else f"{FIRST_NODE_PORT}-{node_port(num_nodes)}"
    return f"NodeName={names} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports} {rest}"


def node_range(num_nodes: int) -> str:
    """`node[1-N]`; a one-node range ("node[1-1]") is legal but reads oddly in sinfo."""
    return "node1" if num_nodes == 1 else f"node[1-{num_nodes}]"


def render_slurm_conf(layout: LabLayout, num_nodes: int, template: str | None = None, *,
                      controller_addr: str | None = None, addresses: list[str] | None = None,
                      gpus_per_node: int = 0, preempt_mode: str = "requeue") -> str:
    """The lab's slurm.conf, header included; `controller_addr` and `addresses` (one per
    node) for a lab whose nodes have network namespaces of their own; `gpus_per_node` for
    nodes with GPUs (GresTypes=gpu, and gres.conf from `dtk.lab.gres`); `preempt_mode`
    `requeue` or `cancel` (PREEMPT_MODES) for what a preemption does to a `debug` job."""
    if template is None:
        template = TEMPLATE.read_text()
    body = string.Template(template).substitute(
        num_nodes=num_nodes,
        controller=f"localhost({controller_addr})" if controller_addr else "localhost",
        node_lines=node_lines(num_nodes, addresses, gpus_per_node),
        gres_types="GresTypes=gpu" if gpus_per_node else "# No GPUs (python -m dtk.lab up --gpus-per-node N adds them).",
        cpus=CPUS_PER_NODE,
        grace_time_s=GRACE_TIME_S,
        preempt_mode=PREEMPT_MODES[preempt_mode],
        state_dir=layout.state_dir,
        spool_dir=layout.spool_dir,
        log_dir=layout.log_dir,
        pid_dir=layout.pid_dir,
    )
    return f"{CONF_HEADER}\n{body}"


def is_ours(path: Path) -> bool:
    """True when `path` is absent or starts with dtk's header."""
    try:
        with path.open() as f:
            return f.readline().rstrip("\n") == CONF_HEADER
    except FileNotFoundError:
        return True


def write_system_conf(text: str, path: Path) -> None:
    """Install the config where every Slurm command looks by default. The caller has
    checked `is_ours(path)`; the rename makes a reader see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".dtk-tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)  # users' sbatch/squeue read it
    tmp.replace(path)


def hosts_with_lab_line(text: str, num_nodes: int, addresses: list[str] | None = None,
                        controller: str | None = None) -> str:
    """/etc/hosts text in which node1..nodeN resolve to 127.0.0.1 through one marked line,
    or each to its own address (`addresses`, the lab with --netns), a marked line each,
    and the controller's address there as `dtklab-controller`: inside a node's namespace no
    name server answers, and a reverse lookup of an address that no line names waits 10 s
    (torch's store looks up the peers of its connections).

    Slurm itself reaches the nodes by NodeAddr; the names must resolve for code that uses
    a node name as an address (a torch.distributed master address, for instance)."""
    kept = [line for line in text.splitlines() if not line.rstrip().endswith(HOSTS_MARK)]
    if addresses is None:
        kept.append(f"127.0.0.1 {' '.join(node_names(num_nodes))} {HOSTS_MARK}")
    else:
        kept += [f"{addr} {node_name(k)} {HOSTS_MARK}" for k, addr in enumerate(addresses, start=1)]
        if controller:
            kept.append(f"{controller} dtklab-controller {HOSTS_MARK}")
    return "\n".join(kept) + "\n"


def ensure_hosts(num_nodes: int, path: Path, addresses: list[str] | None = None, controller: str | None = None) -> None:
    old = path.read_text()
    new = hosts_with_lab_line(old, num_nodes, addresses, controller)
    if new != old:
        replace_text(path, new)


def replace_text(path: Path, text: str) -> None:
    """Replace a system file so that a reader sees the old text or the new, never half:
    a new file beside it, renamed over it, with the old one's mode and owner. Where the
    file is a mount point (/etc/hosts is often a bind mount in a container) a rename
    cannot replace it; then it is rewritten in place, in one write."""
    info = path.stat()
    tmp = path.with_name(f".{path.name}.dtk-tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, info.st_mode & 0o7777)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chown(tmp, info.st_uid, info.st_gid)
        os.replace(tmp, path)
        return
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno not in (errno.EBUSY, errno.EXDEV, errno.EPERM, errno.EACCES, errno.EROFS):
            raise
    with path.open("r+") as f:
        f.write(text)
        f.truncate()


def ensure_munge_key(path: Path) -> bool:
    """Create munge's shared secret if the machine has none; True when one was created.
    munged refuses a key that is readable by anyone but its owner, user munge."""
    if path.exists():
        return False
    munge = pwd.getpwnam("munge")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chown(path.parent, munge.pw_uid, munge.pw_gid)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    os.chown(path, munge.pw_uid, munge.pw_gid)
    return True
