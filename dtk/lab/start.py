"""Starting the lab's daemons and waiting for its nodes.

Called by `up` only after the machine has been found free of any other Slurm. Each daemon
is recorded as soon as it runs, so that a failure part-way can stop exactly those.
"""

from __future__ import annotations

import os
import pwd
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dtk.lab import daemons, files, gres, netns
from dtk.lab.daemons import Daemon
from dtk.lab.files import LabLayout, SystemFiles
from dtk.lab.programs import LabError, Log, program, slurm
from dtk.lab.record import LabRecord, write_record

# munged's socket stays at its compiled-in default so that Slurm and the munge tools find
# it without an AuthInfo setting.
MUNGE_RUN_DIR = Path("/run/munge")


def set_preempt_mode(layout: LabLayout, system: SystemFiles, record: LabRecord, mode: str, log: Log) -> LabRecord:
    """What a preemption does to a `debug` job on the running lab, changed in place:
    slurm.conf rewritten with that PreemptMode, then `scontrol reconfigure` (jobs go on)."""
    record = replace(record, preempt_mode=mode)
    addresses = [netns.node_address(k) for k in range(1, record.num_nodes + 1)] if record.netns else None
    conf = files.render_slurm_conf(layout, record.num_nodes, addresses=addresses,
                                   controller_addr=netns.bridge_address() if record.netns else None,
                                   gpus_per_node=record.num_gpus, preempt_mode=mode)
    layout.conf.write_text(conf)
    files.write_system_conf(conf, system.slurm_conf)
    proc = slurm(["scontrol", "reconfigure"], system)
    if proc.returncode != 0:
        raise LabError(f"scontrol reconfigure: {(proc.stderr or proc.stdout).strip()}")
    write_record(layout, record)
    log(f"lab preemption mode: {files.PREEMPT_MODES[mode]} (a job in debug preempted by one in high is"
        f" {'ended, not requeued' if mode == 'cancel' else 'requeued'})")
    return record


def start_all(layout: LabLayout, system: SystemFiles, base: LabRecord, started: list[Daemon], log: Log) -> None:
    """Write the config, then start munged (unless the record already holds one), slurmctld
    and one slurmd per node, appending each to `started` and to the record."""
    num_nodes = base.num_nodes
    if not files.is_ours(system.slurm_conf):  # checked before; checked again just before writing
        raise LabError(f"{system.slurm_conf} exists and was not written by dtk.lab; the lab will not overwrite it")
    for folder in layout.fresh_dirs():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    layout.access_state.unlink(missing_ok=True)  # the config below is the plain one: no policy in force
    for name in files.node_names(num_nodes):
        (layout.spool_dir / name).mkdir()
    addresses = [netns.node_address(k) for k in range(1, num_nodes + 1)] if base.netns else None
    conf = files.render_slurm_conf(layout, num_nodes, addresses=addresses,
                                   controller_addr=netns.bridge_address() if base.netns else None,
                                   gpus_per_node=base.num_gpus, preempt_mode=base.preempt_mode)
    layout.conf.write_text(conf)
    write_gres(layout, system, num_nodes, base.num_gpus)
    files.write_system_conf(conf, system.slurm_conf)
    files.ensure_hosts(num_nodes, system.hosts, addresses, netns.bridge_address() if base.netns else None)
    if base.netns:
        write_record(layout, replace(base, daemons=tuple(started)))  # first: a crash from here on leaves a record that says what to remove
        netns.create(files.node_names(num_nodes), lab_root=str(layout.root))

    def record(daemon: Daemon) -> None:
        started.append(daemon)
        write_record(layout, replace(base, daemons=tuple(started)))

    if any(d.program == "munged" for d in started):
        log("using the munged that apt-get started")
    else:
        if files.ensure_munge_key(system.munge_key):
            log(f"created a munge key at {system.munge_key}")
        record(start_munged(layout))
    record(daemons.start("slurmctld", [program("slurmctld"), "-f", str(system.slurm_conf)],
                         layout.pid_dir / "slurmctld.pid", output=startup_log(layout),
                         log=log_file(layout, "slurmctld")))
    for index in range(1, num_nodes + 1):
        record(start_slurmd(layout, system, files.node_name(index), in_netns=base.netns))


def write_gres(layout: LabLayout, system: SystemFiles, num_nodes: int, gpus_per_node: int) -> None:
    """gres.conf beside slurm.conf, and the device files it names. Without GPUs there is
    none: a gres.conf of an earlier GPU lab goes, a foreign one stays untouched."""
    if not gpus_per_node:
        gres.make_devices(layout.root, 0)
        if system.gres_conf.exists() and files.is_ours(system.gres_conf):
            system.gres_conf.unlink()
        return
    if not files.is_ours(system.gres_conf):
        raise LabError(f"{system.gres_conf} exists and was not written by dtk.lab; the lab will not overwrite it")
    gres.make_devices(layout.root, gpus_per_node)
    shape = gres.node_shape(gpus_per_node, files.CPUS_PER_NODE)
    files.write_system_conf(gres.render_gres_conf(files.CONF_HEADER, lab_root=layout.root,
                                                  nodes=files.node_range(num_nodes), shape=shape), system.gres_conf)


def start_slurmd(layout: LabLayout, system: SystemFiles, name: str, *, in_netns: bool) -> Daemon:
    """slurmd for node `name`; `in_netns`: inside the node's network namespace, where its
    job steps run too (they are its children)."""
    prefix = netns.daemon_prefix(name, layout.root / "netns-hold") if in_netns else []
    return daemons.start(f"slurmd {name}", [*prefix, program("slurmd"), "-f", str(system.slurm_conf), "-N", name],
                         layout.pid_dir / f"slurmd-{name}.pid", output=startup_log(layout),
                         log=log_file(layout, f"slurmd {name}"))


def start_munged(layout: LabLayout) -> Daemon:
    # munged refuses to run as root and checks that its files belong to its own user.
    munge = pwd.getpwnam("munge")
    for folder in (MUNGE_RUN_DIR, layout.munge_dir):
        folder.mkdir(parents=True, exist_ok=True)
        os.chown(folder, munge.pw_uid, munge.pw_gid)
    MUNGE_RUN_DIR.chmod(0o755)  # clients connect to the socket inside
    layout.munge_dir.chmod(0o700)
    pid_file = layout.munge_dir / "munged.pid"
    argv = [program("munged"), f"--pid-file={pid_file}", f"--log-file={log_file(layout, 'munged')}",
            f"--seed-file={layout.munge_dir / 'munged.seed'}"]
    return daemons.start("munged", argv, pid_file, output=startup_log(layout),
                         log=log_file(layout, "munged"), user="munge")


def wait_for_nodes(layout: LabLayout, system: SystemFiles, watched: list[Daemon], num_nodes: int,
                   timeout_s: float, ready: Callable[[str], bool]) -> None:
    """Wait until sinfo shows every node in a `ready` state, failing fast if a daemon dies."""
    wanted = set(files.node_names(num_nodes))
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        for d in watched:
            if not daemons.is_alive(d):
                raise LabError(f"{d.label} exited while the lab came up: " + daemons.tail(log_file(layout, d.label)))
        states = node_states(system)
        if wanted <= states.keys() and all(ready(states[n]) for n in wanted):
            return
        time.sleep(0.2)
    shown = ", ".join(f"{n}={states.get(n, 'missing')}" for n in files.node_names(num_nodes))
    raise LabError(f"lab nodes not ready after {timeout_s:.0f} s ({shown}); logs in {layout.log_dir}")


def node_states(system: SystemFiles) -> dict[str, str]:
    """Node name -> long state ("idle", "down*", ...) as sinfo reports it; empty while the
    controller does not answer yet."""
    result = slurm(["sinfo", "-h", "-N", "-o", "%N %T"], system)
    if result.returncode != 0:
        return {}
    return dict(line.split(maxsplit=1) for line in result.stdout.splitlines() if " " in line)


def log_file(layout: LabLayout, label: str) -> Path:
    """Where the daemon `label` ("slurmd node2") writes its own log: the paths that
    slurm.conf and munged's flags name."""
    program_name, _, node = label.partition(" ")
    if program_name == "munged":
        return layout.munge_dir / "munged.log"
    if program_name == "slurmd":
        return layout.log_dir / f"slurmd-{node}.log"
    return layout.log_dir / "slurmctld.log"


def startup_log(layout: LabLayout) -> Path:
    return layout.log_dir / "startup.log"
