"""The lab: a real Slurm cluster of N nodes on this one machine.

One munged, one slurmctld and one `slurmd -N nodeK` per node, all on 127.0.0.1, each
slurmd on its own port. Everything the lab owns lives in one directory (`lab_dir()`):
the rendered slurm.conf, the record of the daemons it started (and who started them),
their logs, spools, pid files and the controller's state. The same config goes to
/etc/slurm/slurm.conf so that sbatch, squeue, sinfo, scontrol and srun work for every
user without setup.

A machine with a Slurm of its own is left alone: `up` looks first (ownership.py) and
refuses before it installs, writes or stops anything. `up` and `down` stop only the lab's
own processes.

`up` always starts a fresh cluster (no jobs, no node history) except when the lab is
already up with the same node count, which it leaves alone, or when only some slurmd
died, which it restarts. A different node count means down, then up. The lab is shared,
so `down` (and an `up` that restarts) refuses while jobs are on it unless forced.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from dtk.lab import daemons, files, gres, netns, ownership, session
from dtk.lab.daemons import Daemon, DaemonError
from dtk.lab.files import LabLayout, SystemFiles
from dtk.lab.jobs import LabJob, lab_jobs
from dtk.lab.programs import LabError, Log, ensure_installed, find_program, require_root, slurm
from dtk.lab.record import LabRecord, read_record, write_record
from dtk.lab.start import set_preempt_mode, start_all, start_slurmd, wait_for_nodes

DEFAULT_DIR = Path("/var/lib/dtk-lab")
MAX_NODES = 64
_NETNS = {True: ", each in its own network namespace", False: ""}


@dataclass(frozen=True)
class LabStatus:
    """A snapshot of the lab. `up` means recorded and every recorded daemon alive."""

    layout: LabLayout
    record: LabRecord | None
    alive: dict[str, bool] = field(default_factory=dict)
    sinfo: str = ""
    jobs: tuple[LabJob, ...] | None = None
    """Jobs not yet ended; None when the controller does not answer."""

    @property
    def up(self) -> bool:
        return self.record is not None and all(self.alive.values())

    @property
    def num_nodes(self) -> int:
        return self.record.num_nodes if self.record else 0


def lab_dir() -> Path:
    """The lab directory: $DTK_LAB_DIR, else /var/lib/dtk-lab."""
    return Path(os.environ.get("DTK_LAB_DIR") or DEFAULT_DIR)


def status(*, root: Path | None = None) -> LabStatus:
    """Read the record and look at the processes and the queue; needs no privileges."""
    layout = LabLayout(root or lab_dir())
    record = read_record(layout)
    if record is None:
        return LabStatus(layout, None)
    alive = {d.label: daemons.is_alive(d) for d in record.daemons}
    sinfo, jobs = "", None
    if alive.get("slurmctld") and find_program("sinfo"):
        system = files.system_files()
        result = slurm(["sinfo"], system)
        sinfo = result.stdout or result.stderr
        found = lab_jobs(lambda argv: slurm(argv, system))
        jobs = tuple(found) if found is not None else None
    return LabStatus(layout, record, alive, sinfo, jobs)


def up(num_nodes: int = 3, *, install: bool = True, root: Path | None = None, timeout_s: float = 60.0,
       force: bool = False, netns: bool = False, gpus_per_node: int = 0, preempt_mode: str = "requeue",
       take: bool = False, log: Log = print) -> LabStatus:
    """Bring the lab up with `num_nodes` idle nodes, each in a network namespace of its own
    with `netns` (dtk.lab.netns) and with `gpus_per_node` GPUs that Slurm schedules
    (dtk.lab.gres), and a preemption that requeues or (`preempt_mode="cancel"`) ends a job;
    see the module doc for what it keeps. The lab is then this process's session's
    (dtk.lab.session): refused while another session holds it, unless `take`."""
    if not 1 <= num_nodes <= MAX_NODES:
        raise LabError(f"--nodes={num_nodes} is out of range: the lab runs 1 to {MAX_NODES} nodes")
    try:
        gres.node_shape(gpus_per_node, files.CPUS_PER_NODE)
    except ValueError as exc:
        raise LabError(f"--gpus-per-node={gpus_per_node}: {exc}") from None
    require_root("up")
    layout, system = LabLayout(root or lab_dir()), files.system_files()
    # Before anything is written, installed or stopped.
    signs = ownership.foreign_signs(layout, read_record(layout), system)
    if signs:
        raise LabError(ownership.refusal(signs))
    _prepare_dir(layout)
    with _locked(layout):
        session.check(layout, doing="python -m dtk.lab up", take=take)
        record = read_record(layout)
        strangers = ownership.strangers(layout, record)  # again: another `up` may have run meanwhile
        if strangers:
            raise LabError(ownership.refusal(["processes that the lab did not start are running: "
                                              + ", ".join(ownership.describe(p) for p in strangers)]))
        session.claim(layout, doing="python -m dtk.lab up", take=take)
        if record is not None:
            dead = [d for d in record.daemons if not daemons.is_alive(d)]
            same = (record.num_nodes, record.netns, record.num_gpus) == (num_nodes, netns, gpus_per_node)
            if same and not dead:
                log(f"lab is already up with {num_nodes} nodes{_NETNS[netns]}{_gpus(gpus_per_node)} ({layout.root})")
                if record.preempt_mode != preempt_mode:
                    set_preempt_mode(layout, system, record, preempt_mode, log)
                return status(root=layout.root)
            if same and all(d.program == "slurmd" for d in dead):
                if record.preempt_mode != preempt_mode:
                    record = set_preempt_mode(layout, system, record, preempt_mode, log)
                return _restart_nodes(layout, system, record, dead, timeout_s, log)
            why = (f"from {record.num_nodes} to {num_nodes} nodes" if record.num_nodes != num_nodes
                   else f"from {record.num_gpus} to {gpus_per_node} GPUs per node"
                   if record.num_gpus != gpus_per_node else ("with each node in a network namespace of its own" if netns
                         else "with every node on this machine's network stack") if record.netns != netns
                   else "because " + ", ".join(d.label for d in dead) + " died")
            _refuse_busy(layout, system, record, force, f"restarting the lab {why}")
            log(f"restarting the lab {why}")
        _stop_all(layout, record or LabRecord(0), log)  # with no record: leftovers of a lab that lost it
        started = _install(install, layout, log)
        try:
            start_all(layout, system, LabRecord.new(num_nodes, netns=netns, num_gpus=gpus_per_node,
                                                      preempt_mode=preempt_mode), started, log)
            wait_for_nodes(layout, system, started, num_nodes, timeout_s, ready=lambda state: state == "idle")
        except (LabError, DaemonError, OSError) as exc:
            # Leave nothing half-started: stop exactly what this call started.
            try:
                _stop_all(layout, LabRecord(num_nodes, tuple(started), netns=netns), lambda _: None)
            except (LabError, DaemonError) as cleanup:
                raise LabError(f"{exc}; and while stopping what had started: {cleanup}") from None
            raise LabError(str(exc)) from None
        log(f"lab is up: {num_nodes} nodes{_NETNS[netns]}{_gpus(gpus_per_node)}, partitions debug (default) and high; "
            f"config {system.slurm_conf}, state in {layout.root}")
        return status(root=layout.root)


def _gpus(gpus_per_node: int) -> str:
    return f", {gpus_per_node} GPUs each (GRES, on two sockets)" if gpus_per_node else ""


def down(*, root: Path | None = None, force: bool = False, take: bool = False, log: Log = print) -> None:
    """Stop every process of the lab: its job steps, its daemons, and end its session.
    Refused while jobs are on the lab, unless `force`, and while another session holds it
    (dtk.lab.session), unless `take`."""
    require_root("down")
    layout = LabLayout(root or lab_dir())
    if not layout.marker.exists():
        log(f"lab is not up (no lab in {layout.root})")
        return
    with _locked(layout):
        session.check(layout, doing="python -m dtk.lab down" + " --force" * force, take=take)
        record = read_record(layout)
        census = ownership.census(layout, record)
        if record is None and not (census.ours or census.steps) and netns.owner() != str(layout.root):
            session.release(layout)
            log(f"lab is not up ({layout.root})")
            return
        _refuse_busy(layout, files.system_files(), record, force, "stopping the lab")
        _stop_all(layout, record or LabRecord(0), log)
        session.release(layout)
        log("lab is down")


def slow(node: str, rate: str | None, *, root: Path | None = None, log: Log = print) -> None:
    """Limit what `node` sends to `rate` (a tc rate such as 100mbit), or lift the limit
    (None). Needs a lab with network namespaces: without them the nodes share one stack."""
    require_root("slow")
    layout = LabLayout(root or lab_dir())
    if read_record(layout) is None:
        raise LabError(f"no lab is running from {layout.root}; start one with python -m dtk.lab up --netns")
    with _locked(layout):
        session.check(layout, doing=f"python -m dtk.lab slow {node}")
        record = read_record(layout)
        if record is None or not record.netns:
            raise LabError("`python -m dtk.lab slow` needs a lab whose nodes have network namespaces of their own"
                           " (python -m dtk.lab up --netns); without them every node shares one network stack")
        if node not in files.node_names(record.num_nodes):
            raise LabError(f"node {node!r} is not in the lab; it has {', '.join(files.node_names(record.num_nodes))}")
        netns.slow(node, None if rate is None else netns.check_rate(rate))
        limits = dict(record.slow) | {node: rate}
        write_record(layout, replace(record, slow=tuple(sorted((n, r) for n, r in limits.items() if r))))
    log(f"{node} sends at most {rate} ({netns.qdisc(node)})" if rate else f"{node} sends at full speed again")


def _install(install: bool, layout: LabLayout, log: Log) -> list[Daemon]:
    """Install Slurm and munge if missing. A munged that the package started is the lab's
    from then on (returned, to be recorded): the lab caused it and `down` stops it."""
    before = {p.pid for p in ownership.census(layout, None).foreign}
    ensure_installed(install, log)
    return [Daemon.of("munged", p) for p in ownership.census(layout, None).foreign
            if p.pid not in before and p.info["name"] == "munged"]


def _refuse_busy(layout: LabLayout, system: SystemFiles, record: LabRecord | None, force: bool, doing: str) -> None:
    """Refuse to end the jobs on a shared lab, unless forced."""
    if force:
        return
    controller = record is not None and any(d.program == "slurmctld" and daemons.is_alive(d) for d in record.daemons)
    jobs = lab_jobs(lambda argv: slurm(argv, system)) if controller else None
    if jobs:
        raise LabError(f"{doing} would end {len(jobs)} job(s) on the lab: " + ", ".join(j.short() for j in jobs)
                       + "; wait for them, cancel them (scancel JOBID), or pass --force")
    steps = ownership.census(layout, record).steps
    if jobs is None and steps:
        raise LabError(f"{doing} would kill {len(steps)} running job process(es) of the lab (pids "
                       + ", ".join(str(p.pid) for p in steps[:8]) + "); pass --force to kill them")


def _restart_nodes(layout: LabLayout, system: SystemFiles, record: LabRecord, dead: list[Daemon],
                   timeout_s: float, log: Log) -> LabStatus:
    """Bring back slurmds that died (a node-failure drill, say) without touching jobs."""
    log("restarting " + ", ".join(d.label for d in dead))
    fresh = {d.label: start_slurmd(layout, system, d.label.split()[1], in_netns=record.netns) for d in dead}
    new_record = replace(record, daemons=tuple(fresh.get(d.label, d) for d in record.daemons))
    write_record(layout, new_record)
    # A node that went DOWN comes back by itself (ReturnToService=2) once its slurmd
    # registers; it may be busy or drained, but it must answer ("*": not responding).
    wait_for_nodes(layout, system, list(new_record.daemons), record.num_nodes, timeout_s,
                   ready=lambda state: not state.endswith("*") and not state.startswith("down"))
    return status(root=layout.root)


def _stop_all(layout: LabLayout, record: LabRecord, log: Log) -> None:
    """Stop the lab's processes, and only those (ownership.py says which they are)."""
    census = ownership.census(layout, record)
    if census.steps:
        # A slurmstepd outlives its slurmd: stopping the daemons alone would leave jobs running.
        daemons.kill(census.steps)
        log(f"killed {len(census.steps)} job processes (the lab's slurmstepd and their tasks)")
    # Nodes first, controller next, munged last: each still has what it talks to.
    for line in daemons.stop(list(reversed(record.daemons))):
        log(line)
    # What is left: helpers such as slurmctld's slurmscriptd, which are exiting with their
    # daemon anyway, and lab daemons missing from the record (a record lost in a crash).
    rest = list(ownership.census(layout, record).ours)
    if rest:
        log("stopping the lab's other processes: " + ", ".join(ownership.describe(p) for p in rest))
        daemons.terminate(rest, grace_s=5.0)
    after = ownership.census(layout, record)
    leftover = [f"{d.label} (pid {d.pid})" for d in record.daemons if daemons.is_alive(d)]
    leftover += [ownership.describe(p) for p in (*after.steps, *after.ours)]
    if leftover:
        raise LabError("still running after stopping the lab: " + ", ".join(leftover))
    # Once nothing of the lab runs in them: its namespaces, veths, bridge (and their qdiscs).
    if record.netns or netns.owner() == str(layout.root):
        removed = netns.remove()
        if removed:
            log("removed the network namespaces and bridge: " + ", ".join(removed))
    layout.record.unlink(missing_ok=True)


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
