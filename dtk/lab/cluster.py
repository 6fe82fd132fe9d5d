"""The lab: a real Slurm cluster of N nodes on this one machine.

One munged, one slurmctld and one `slurmd -N nodeK` per node, all on 127.0.0.1, each
slurmd on its own port. Everything the lab owns lives in one directory (`lab_dir()`):
the rendered slurm.conf, the record of the daemons it started, their logs, spools, pid
files and the controller's state. The same config goes to /etc/slurm/slurm.conf so that
sbatch, squeue, sinfo, scontrol and srun work for every user without setup.

`up` always starts a fresh cluster (no jobs, no node history) except when the lab is
already up with the same node count, which it leaves alone, or when only some slurmd
died, which it restarts. A different node count means down, then up: jobs are lost.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dtk.errors import UserError
from dtk.lab import daemons, files
from dtk.lab.daemons import Daemon, DaemonError
from dtk.lab.files import LabLayout

DEFAULT_DIR = Path("/var/lib/dtk-lab")
MAX_NODES = 64
PACKAGES = ("slurm-wlm", "munge")
PROGRAMS = ("munged", "munge", "slurmctld", "slurmd", "sinfo", "srun", "sbatch", "squeue", "scontrol")
# munged's socket stays at its compiled-in default so that Slurm and the munge tools find
# it without an AuthInfo setting.
MUNGE_RUN_DIR = Path("/run/munge")

Log = Callable[[str], None]


class LabError(UserError):
    """Something on this machine stops the lab; the message says what to do about it."""


@dataclass(frozen=True)
class LabRecord:
    """What `up` started, as written to the lab directory for `status` and `down`."""

    num_nodes: int
    daemons: tuple[Daemon, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"num_nodes": self.num_nodes,
                           "daemons": [d.to_json() for d in self.daemons]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> LabRecord:
        data = json.loads(text)
        return cls(int(data["num_nodes"]), tuple(Daemon.from_json(d) for d in data["daemons"]))


@dataclass(frozen=True)
class LabStatus:
    """A snapshot of the lab. `up` means recorded and every recorded daemon alive."""

    layout: LabLayout
    record: LabRecord | None
    alive: dict[str, bool] = field(default_factory=dict)
    sinfo: str = ""

    @property
    def up(self) -> bool:
        return self.record is not None and all(self.alive.values())

    @property
    def num_nodes(self) -> int:
        return self.record.num_nodes if self.record else 0


def lab_dir() -> Path:
    """The lab directory: $DTK_LAB_DIR, else /var/lib/dtk-lab."""
    return Path(os.environ.get("DTK_LAB_DIR") or DEFAULT_DIR)


def find_program(name: str) -> str | None:
    # A user's PATH often lacks /usr/sbin, where Debian puts the daemons.
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if find_program(name) is None]


def status(*, root: Path | None = None) -> LabStatus:
    """Read the record and look at the processes; needs no privileges."""
    layout = LabLayout(root or lab_dir())
    record = _read_record(layout)
    if record is None:
        return LabStatus(layout, None)
    alive = {d.label: daemons.is_alive(d) for d in record.daemons}
    sinfo = ""
    if alive.get("slurmctld") and find_program("sinfo"):
        result = _slurm(["sinfo"])
        sinfo = result.stdout or result.stderr
    return LabStatus(layout, record, alive, sinfo)


def up(num_nodes: int = 3, *, install: bool = True, root: Path | None = None,
       timeout_s: float = 60.0, log: Log = print) -> LabStatus:
    """Bring the lab up with `num_nodes` idle nodes; see the module doc for what it keeps."""
    if not 1 <= num_nodes <= MAX_NODES:
        raise LabError(f"--nodes={num_nodes} is out of range: the lab runs 1 to {MAX_NODES} nodes")
    _require_root("up")
    layout = LabLayout(root or lab_dir())
    _prepare_dir(layout)
    with _locked(layout):
        record = _read_record(layout)
        if record is not None:
            dead = [d for d in record.daemons if not daemons.is_alive(d)]
            if record.num_nodes == num_nodes and not dead:
                log(f"lab is already up with {num_nodes} nodes ({layout.root})")
                return status(root=layout.root)
            if record.num_nodes == num_nodes and all(d.program == "slurmd" for d in dead):
                return _restart_nodes(layout, record, dead, timeout_s, log)
            why = (f"from {record.num_nodes} to {num_nodes} nodes" if record.num_nodes != num_nodes
                   else "because " + ", ".join(d.label for d in dead) + " died")
            log(f"restarting the lab {why}")
            _stop_all(layout, record, log)
        _ensure_installed(install, log)
        started: list[Daemon] = []
        try:
            _start_all(layout, num_nodes, started, log)
            _wait_for_nodes(layout, started, num_nodes, timeout_s, ready=lambda state: state == "idle")
        except (LabError, DaemonError, OSError) as exc:
            # Leave nothing half-started: stop exactly what this call started.
            try:
                _stop_all(layout, LabRecord(num_nodes, tuple(started)), lambda _: None)
            except LabError as cleanup:
                raise LabError(f"{exc}; and while stopping what had started: {cleanup}") from None
            raise LabError(str(exc)) from None
        log(f"lab is up: {num_nodes} nodes, partitions debug (default) and high; "
            f"config {files.SYSTEM_CONF}, state in {layout.root}")
        return status(root=layout.root)


def down(*, root: Path | None = None, log: Log = print) -> None:
    """Stop every daemon the lab started (and the job processes under them)."""
    _require_root("down")
    layout = LabLayout(root or lab_dir())
    if not layout.marker.exists():
        log(f"lab is not up (no lab in {layout.root})")
        return
    with _locked(layout):
        record = _read_record(layout)
        if record is None:
            log(f"lab is not up ({layout.root})")
            return
        _stop_all(layout, record, log)
        log("lab is down")


def _start_all(layout: LabLayout, num_nodes: int, started: list[Daemon], log: Log) -> None:
    """Start munged (unless one already serves), slurmctld and the slurmds, recording each
    daemon as soon as it runs so that a failure part-way can stop exactly those."""
    if not files.is_ours(files.SYSTEM_CONF):
        raise LabError(f"{files.SYSTEM_CONF} exists and was not written by dtk.lab; this machine "
                       "has its own Slurm setup, which the lab will not overwrite")
    strays = daemons.processes_named(("slurmctld", "slurmd"))
    if strays:
        raise LabError("Slurm daemons that this lab did not start are running (pids "
                       + ", ".join(str(p.pid) for p in strays) + "); stop them first")
    for folder in layout.fresh_dirs():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    for name in files.node_names(num_nodes):
        (layout.spool_dir / name).mkdir()
    conf = files.render_slurm_conf(layout, num_nodes)
    layout.conf.write_text(conf)
    files.write_system_conf(conf)
    files.ensure_hosts(num_nodes)

    def record(daemon: Daemon) -> None:
        started.append(daemon)
        _write_record(layout, LabRecord(num_nodes, tuple(started)))

    if _munge_works():
        log("using the munged already running on this machine")
    else:
        if files.ensure_munge_key():
            log(f"created a munge key at {files.MUNGE_KEY}")
        record(_start_munged(layout))
    record(daemons.start("slurmctld", [_program("slurmctld"), "-f", str(files.SYSTEM_CONF)],
                         layout.pid_dir / "slurmctld.pid", output=_startup_log(layout),
                         log=_log_file(layout, "slurmctld")))
    for index in range(1, num_nodes + 1):
        record(_start_slurmd(layout, files.node_name(index)))


def _start_slurmd(layout: LabLayout, name: str) -> Daemon:
    return daemons.start(f"slurmd {name}",
                         [_program("slurmd"), "-f", str(files.SYSTEM_CONF), "-N", name],
                         layout.pid_dir / f"slurmd-{name}.pid", output=_startup_log(layout),
                         log=_log_file(layout, f"slurmd {name}"))


def _start_munged(layout: LabLayout) -> Daemon:
    # munged refuses to run as root and checks that its files belong to its own user.
    munge = pwd.getpwnam("munge")
    for folder in (MUNGE_RUN_DIR, layout.munge_dir):
        folder.mkdir(parents=True, exist_ok=True)
        os.chown(folder, munge.pw_uid, munge.pw_gid)
    MUNGE_RUN_DIR.chmod(0o755)  # clients connect to the socket inside
    layout.munge_dir.chmod(0o700)
    pid_file = layout.munge_dir / "munged.pid"
    argv = [_program("munged"), f"--pid-file={pid_file}",
            f"--log-file={_log_file(layout, 'munged')}",
            f"--seed-file={layout.munge_dir / 'munged.seed'}"]
    return daemons.start("munged", argv, pid_file, output=_startup_log(layout),
                         log=_log_file(layout, "munged"), user="munge")


def _restart_nodes(layout: LabLayout, record: LabRecord, dead: list[Daemon], timeout_s: float,
                   log: Log) -> LabStatus:
    """Bring back slurmds that died (a node-failure drill, say) without touching jobs."""
    log("restarting " + ", ".join(d.label for d in dead))
    fresh = {d.label: _start_slurmd(layout, d.label.split()[1]) for d in dead}
    new_record = LabRecord(record.num_nodes, tuple(fresh.get(d.label, d) for d in record.daemons))
    _write_record(layout, new_record)
    # A node that went DOWN comes back by itself (ReturnToService=2) once its slurmd
    # registers; it may be busy or drained, but it must answer ("*": not responding).
    _wait_for_nodes(layout, list(new_record.daemons), record.num_nodes, timeout_s,
                    ready=lambda state: not state.endswith("*") and not state.startswith("down"))
    return status(root=layout.root)


def _stop_all(layout: LabLayout, record: LabRecord, log: Log) -> None:
    for line in daemons.kill_job_steps():
        log(line)
    # Nodes first, controller next, munged last: each still has what it talks to.
    for line in daemons.stop(list(reversed(record.daemons))):
        log(line)
    leftover = [f"{d.label} (pid {d.pid})" for d in record.daemons if daemons.is_alive(d)]
    leftover += daemons.leftover_slurm_processes()
    if leftover:
        raise LabError("still running after stopping the lab: " + ", ".join(leftover))
    layout.record.unlink(missing_ok=True)


def _wait_for_nodes(layout: LabLayout, watched: list[Daemon], num_nodes: int, timeout_s: float,
                    ready: Callable[[str], bool]) -> None:
    """Wait until sinfo shows every node in a `ready` state, failing fast if a daemon dies."""
    wanted = set(files.node_names(num_nodes))
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        for d in watched:
            if not daemons.is_alive(d):
                raise LabError(f"{d.label} exited while the lab came up: "
                               + daemons.tail(_log_file(layout, d.label)))
        states = _node_states()
        if wanted <= states.keys() and all(ready(states[n]) for n in wanted):
            return
        time.sleep(0.2)
    shown = ", ".join(f"{n}={states.get(n, 'missing')}" for n in files.node_names(num_nodes))
    raise LabError(f"lab nodes not ready after {timeout_s:.0f} s ({shown}); logs in {layout.log_dir}")


def _node_states() -> dict[str, str]:
    """Node name → long state ("idle", "down*", ...) as sinfo reports it; empty while the
    controller does not answer yet."""
    result = _slurm(["sinfo", "-h", "-N", "-o", "%N %T"])
    if result.returncode != 0:
        return {}
    return dict(line.split(maxsplit=1) for line in result.stdout.splitlines() if " " in line)


def _slurm(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_CONF": str(files.SYSTEM_CONF)}
    return subprocess.run([_program(argv[0]), *argv[1:]], capture_output=True, text=True,
                          env=env, timeout=30, check=False)


def _munge_works() -> bool:
    return subprocess.run([_program("munge"), "-n"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, check=False).returncode == 0


def _ensure_installed(install: bool, log: Log) -> None:
    missing = missing_programs()
    if not missing:
        return
    if not install:
        raise LabError(f"{', '.join(missing)} not found and --no-install was given; "
                       "install them with: apt-get install slurm-wlm munge")
    if shutil.which("apt-get") is None:
        raise LabError(f"{', '.join(missing)} not found and there is no apt-get; "
                       "install Slurm and munge, then run this again")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install_cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    log(f"installing {' '.join(PACKAGES)} with apt-get")
    if subprocess.run(install_cmd, env=env, check=False).returncode != 0:
        # A fresh image has no package lists yet.
        subprocess.run(["apt-get", "update"], env=env, check=False)
        if subprocess.run(install_cmd, env=env, check=False).returncode != 0:
            raise LabError("apt-get could not install slurm-wlm and munge; see its output above")
    if missing_programs():
        raise LabError(f"still missing after apt-get: {', '.join(missing_programs())}")


def _program(name: str) -> str:
    path = find_program(name)
    if path is None:
        raise LabError(f"{name} not found; install slurm-wlm and munge (python -m dtk.lab up does it as root)")
    return path


def _require_root(command: str) -> None:
    if os.geteuid() != 0:
        raise LabError(f"`python -m dtk.lab {command}` must run as root: it starts and stops "
                       f"munged and the Slurm daemons (try: sudo python -m dtk.lab {command})")


def _prepare_dir(layout: LabLayout) -> None:
    root = layout.root
    if root.exists() and any(root.iterdir()) and not layout.marker.exists():
        raise LabError(f"{root} is not empty and is not a dtk lab directory; "
                       "set DTK_LAB_DIR to an empty or new folder")
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # munged (user munge) needs to reach its folder inside
    layout.marker.touch()


@contextmanager
def _locked(layout: LabLayout) -> Iterator[None]:
    """One `up` or `down` at a time, e.g. two test sessions starting together."""
    with layout.lock.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _read_record(layout: LabLayout) -> LabRecord | None:
    try:
        return LabRecord.from_json(layout.record.read_text())
    except FileNotFoundError:
        return None


def _write_record(layout: LabLayout, record: LabRecord) -> None:
    tmp = layout.record.with_suffix(".tmp")
    tmp.write_text(record.to_json())
    tmp.replace(layout.record)


def _log_file(layout: LabLayout, label: str) -> Path:
    """Where the daemon `label` ("slurmd node2") writes its own log: the paths that
    slurm.conf and munged's flags name."""
    program, _, node = label.partition(" ")
    if program == "munged":
        return layout.munge_dir / "munged.log"
    if program == "slurmd":
        return layout.log_dir / f"slurmd-{node}.log"
    return layout.log_dir / "slurmctld.log"


def _startup_log(layout: LabLayout) -> Path:
    return layout.log_dir / "startup.log"
