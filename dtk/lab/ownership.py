"""Whose Slurm is this? What the lab checks before it installs, writes or stops anything.

A machine may run a Slurm of its own: a slurm.conf that dtk did not write, a configless
client setup (SLURM_CONF, or a DNS SRV record naming a controller), or Slurm and munge
daemons that the lab did not start. The lab then refuses to start (exit 2, naming every
sign it saw), and whatever it does, it signals only its own processes:

- the daemons it started, by the pid and start time in its record;
- the job steps of its nodes: a slurmstepd is forked twice by its slurmd and so is not
  its descendant, but it works in its slurmd's folder (slurmd changes into its log's
  folder, and a slurmstepd, forked from it, starts there and stays), which is under the
  lab directory, from its fork to its exit; it also keeps its node's log there open,
  though not yet while it starts nor any more while it ends;
- everything that descends from those two.

A Slurm process that is exiting (its working folder already released, not yet a zombie)
is nobody's: it is neither stopped nor taken for another cluster's.

Nothing is ever chosen by process name alone.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

from dtk.lab import daemons, dns, files
from dtk.lab.files import LabLayout, SystemFiles
from dtk.lab.record import LabRecord

# Processes that make up a Slurm cluster (or its authentication) on a machine.
CLUSTER_PROGRAMS = ("slurmctld", "slurmd", "slurmstepd", "slurmscriptd", "slurmdbd", "slurmrestd", "munged")


@dataclass(frozen=True)
class Census:
    """The Slurm and munge processes on this machine, sorted by owner."""

    steps: tuple[psutil.Process, ...]
    """The lab's job steps (slurmstepd) and every process under them: the running jobs."""
    ours: tuple[psutil.Process, ...]
    """Every other process of the lab: its daemons (recorded or not) and their children."""
    foreign: tuple[psutil.Process, ...]
    """Slurm and munge daemons that are none of the lab's."""


def census(layout: LabLayout, record: LabRecord | None) -> Census:
    """Sort this machine's Slurm processes into the lab's and the others (see module doc)."""
    table: dict[int, psutil.Process] = {}
    children: dict[int, list[int]] = defaultdict(list)
    for proc in psutil.process_iter(["name", "ppid"]):
        table[proc.pid] = proc
        children[proc.info["ppid"]].append(proc.pid)
    folders = {p.pid: working_folder(p) for p in table.values()
               if p.info["name"] in CLUSTER_PROGRAMS and daemons.running(p)}
    named = [table[pid] for pid, folder in folders.items() if folder is not None]  # not those exiting
    recorded = {p.pid for d in (record.daemons if record else ()) if (p := daemons.find_process(d))}
    holders = {p.pid for p in named if p.pid not in recorded
               and (_under(folders[p.pid], layout.root) or holds_file_under(p, layout.root))}
    step_roots = {pid for pid in holders if table[pid].info["name"] == "slurmstepd"}
    steps = _subtree(step_roots, children)
    ours = _subtree(recorded | holders, children) - steps
    alive = [p for p in table.values() if daemons.running(p)]
    return Census(
        steps=tuple(p for p in alive if p.pid in steps),
        ours=tuple(p for p in alive if p.pid in ours),
        foreign=tuple(p for p in named if p.pid not in steps | ours),
    )


def strangers(layout: LabLayout, record: LabRecord | None) -> tuple[psutil.Process, ...]:
    """The Slurm and munge processes that are not the lab's (the census's foreign). A job
    step of the lab that is starting or ending, holding no file under the lab's folder yet
    or any more, is the lab's by its working folder, so none is taken for a stranger."""
    return census(layout, record).foreign


def working_folder(proc: psutil.Process) -> Path | None:
    """The process's working folder; None while it exits (the kernel has released it) or
    when it is gone. A process whose folder cannot be read (not root) counts as in `/`."""
    try:
        folder = proc.cwd()
    except psutil.AccessDenied:
        return Path("/")
    except (psutil.NoSuchProcess, psutil.ZombieProcess, FileNotFoundError, ProcessLookupError):
        return None
    return Path(folder) if folder else None


def _under(folder: Path | None, root: Path) -> bool:
    return folder is not None and folder.is_relative_to(root)


def _subtree(roots: Iterable[int], children: Mapping[int, list[int]]) -> set[int]:
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return seen


def holds_file_under(proc: psutil.Process, root: Path) -> bool:
    """True when `proc` has a file inside `root` open (a lab daemon's or step's log)."""
    try:
        return any(Path(f.path).is_relative_to(root) for f in proc.open_files())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def describe(proc: psutil.Process) -> str:
    """`slurmd (pid 12, user root, since 09:14:03)`, for messages."""
    try:
        with proc.oneshot():
            since = datetime.fromtimestamp(proc.create_time()).strftime("%H:%M:%S")
            return f"{proc.name()} (pid {proc.pid}, user {proc.username()}, since {since})"
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
        return f"pid {proc.pid}"


def config_signs(system: SystemFiles, environ: Mapping[str, str], *, dns_budget_s: float = 2.0) -> list[str]:
    """Signs in this machine's configuration of a Slurm cluster that is not the lab's."""
    signs = []
    if not files.is_ours(system.slurm_conf):
        signs.append(f"{system.slurm_conf} exists and was not written by dtk.lab")
    named = environ.get("SLURM_CONF")
    if named and Path(named) != system.slurm_conf and not _written_by_lab(Path(named)):
        signs.append(f"SLURM_CONF={named} names a Slurm config that dtk.lab did not write")
    found = dns.slurmctld_records(system.resolv_conf, budget_s=dns_budget_s)
    if found is not None:
        name, targets = found
        signs.append(f"DNS answers the SRV record {name} with {', '.join(targets)}, so Slurm commands here "
                     "would find that controller (a configless cluster)")
    return signs


def _written_by_lab(path: Path) -> bool:
    return path.is_file() and files.is_ours(path)


def foreign_signs(layout: LabLayout, record: LabRecord | None, system: SystemFiles,
                  environ: Mapping[str, str] | None = None) -> list[str]:
    """Every sign that this machine has a Slurm of its own; empty when the lab may run."""
    signs = config_signs(system, os.environ if environ is None else environ)
    found = strangers(layout, record)
    if found:
        signs.append("processes that the lab did not start are running: "
                     + ", ".join(describe(p) for p in found))
    if any(p.info["name"] == "munged" for p in found):
        signs.append("a munged that serves no cluster can be stopped (systemctl stop munge) for the lab "
                     "to start its own")
    return signs


def refusal(signs: list[str]) -> str:
    """The one-line message for `up` on a machine with its own Slurm."""
    return ("this machine has a Slurm (or munge) that is not the lab's: " + "; ".join(signs)
            + ". The lab installed, wrote and stopped nothing; run it on a machine or container "
            "without another Slurm")
