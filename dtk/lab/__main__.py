"""python -m dtk.lab up [--nodes N] [--gpus-per-node G] [--netns] [--preempt-mode {requeue,cancel}] [--no-install] [--force] [--take] | status | slow NODE RATE | down [--force] [--take]"""

from __future__ import annotations

import argparse
import time

from dtk.common.errors import ArgumentParser, run_cli
from dtk.lab import access as lab_access
from dtk.lab import cluster, files, netns, session
from dtk.lab.daemons import DaemonError
from dtk.lab.programs import LabError

TAKE_HELP = ("take the lab over from another session that holds it (one whose process has ended is taken over"
             " without it); that session's jobs and tests then run on a lab that may change under them")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m dtk.lab",
                     description="A real Slurm cluster on this machine: one slurmctld and one "
                                 "slurmd per node, partitions debug (default) and high. "
                                 f"State lives in $DTK_LAB_DIR (default {cluster.DEFAULT_DIR}).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    start = commands.add_parser("up", help="start the cluster (root); does nothing if already up")
    start.add_argument("--nodes", type=int, default=3, metavar="N",
                       help=f"number of nodes, 1 to {cluster.MAX_NODES} (default 3); a different "
                            "count than the running lab restarts it, and its jobs are lost")
    start.add_argument("--no-install", action="store_true",
                       help="fail instead of installing slurm-wlm and munge with apt-get")
    start.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                       help="how long to wait for every node to be idle (default 60)")
    start.add_argument("--force", action="store_true",
                       help="restart with another node count even though jobs are on the lab (they end)")
    start.add_argument("--take", action="store_true", help=TAKE_HELP)
    start.add_argument("--access", metavar="FILE", default=None,
                       help="an access policy (conf/access/NAME.yaml, or its NAME): partitions admit its submitter "
                            "group only (AllowGroups), and its account only, with accounting, when it names one; "
                            "--access open admits every user again; without --access a running lab keeps the policy "
                            "it has, and a lab that was down starts open")
    start.add_argument("--netns", action="store_true",
                       help="each node in a network namespace of its own, with its own address on a veth (lab0)"
                            " joined by a bridge, so jobs see separate network stacks; see docs/lab.md")
    start.add_argument("--preempt-mode", choices=sorted(files.PREEMPT_MODES), default="requeue",
                       help="what a preemption (a job in partition high) does to a job in debug: requeue it (Slurm's"
                            " PreemptMode=REQUEUE, the default) or end it (CANCEL, as some sites do); a running lab"
                            " switches in place")
    start.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                       help="GPUs Slurm schedules on each node (GRES gpu:G, device files in the lab folder,"
                            " half on each of two sockets), for checking GPU binding without GPUs; workers"
                            " there train on the CPU (dist.device=cpu). Default 0: no GPUs")
    slow = commands.add_parser("slow", help="limit what one node sends (tc tbf on its veth), to make a slow node;"
                                            " needs a lab started with --netns (root)")
    slow.add_argument("node", metavar="NODE", help="the node, e.g. node2")
    slow.add_argument("rate", metavar="RATE", help="a tc rate (100mbit, 1gbit, 500kbit), or off to lift the limit")
    commands.add_parser("status", help="who started the lab, its jobs (whose, which run), sinfo and its daemons; "
                                       "exit 0 when up, 1 if not")
    stop = commands.add_parser("down", help="stop every process the lab started (root); refused while jobs "
                                            "are on the lab")
    stop.add_argument("--force", action="store_true", help="stop it even though jobs are on the lab (they end)")
    stop.add_argument("--take", action="store_true", help=TAKE_HELP)
    return parser


def describe(status: cluster.LabStatus) -> str:
    """The report `status` prints."""
    if status.record is None:
        return f"lab: down (no lab running from {status.layout.root})"
    dead = [label for label, alive in status.alive.items() if not alive]
    state = "up" if status.up else "degraded, dead: " + ", ".join(dead)
    record = status.record
    gpus = f", {record.num_gpus} GPUs each" if record.num_gpus else ""
    lines = [f"lab: {state}; {status.num_nodes} nodes{gpus}; state in {status.layout.root}"]
    if record.started_by:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.started_at))
        lines.append(f"started by {record.started_by} on {record.host} at {since}")
    held = session.holder(status.layout)
    lines.append(f"session: {held.line()}" if held else "session: none (the next up takes the lab)")
    if status.jobs is None:
        lines.append("jobs: unknown (the controller does not answer)")
    elif not status.jobs:
        lines.append("jobs: none")
    else:
        lines.append(f"jobs: {len(status.jobs)}")
        lines.append(f"  {'JOBID':<8} {'USER':<10} {'STATE':<11} {'NODES':<12} NAME  (run RUN_DIR)")
        lines += [f"  {job.line()}" for job in status.jobs]
    if record.netns:
        lines.append(f"network: each node in its own namespace ({netns.NS_PREFIX}NODE), {netns.NODE_IFACE}"
                     f" {netns.node_address(1)}.. on bridge {netns.BRIDGE} {netns.bridge_address()}")
        lines += [f"  {node} sends at most {rate}" for node, rate in record.slow]
    if record.preempt_mode != "requeue":
        lines.append(f"preemption: PreemptMode={files.PREEMPT_MODES[record.preempt_mode]} (a preempted job in debug"
                     " is ended, not requeued; python -m dtk.lab up brings back REQUEUE)")
    lines.append(lab_access.describe(status.layout))
    lines.append("daemons:")
    for daemon in status.record.daemons:
        lines.append(f"  {daemon.label:<14} pid {daemon.pid:<8} "
                     + ("alive" if status.alive[daemon.label] else "dead"))
    if status.sinfo:
        lines += ["sinfo:", status.sinfo.rstrip()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "status":
        status = cluster.status()
        print(describe(status))
        return 0 if status.up else 1
    try:
        if args.command == "up":
            before = cluster.status()
            state = lab_access.current(before.layout) if before.record is not None else None
            status = cluster.up(args.nodes, install=not args.no_install, timeout_s=args.timeout, force=args.force,
                                netns=args.netns, gpus_per_node=args.gpus_per_node, preempt_mode=args.preempt_mode,
                                take=args.take)
            policy = lab_access.kept(args.access, state=state, log=print)
            lab_access.apply(policy, layout=status.layout, system=files.system_files(),
                             install=not args.no_install, timeout_s=args.timeout, log=print)
        elif args.command == "slow":
            cluster.slow(args.node, None if args.rate == "off" else args.rate)
        else:
            cluster.down(force=args.force, take=args.take)
    except (DaemonError, OSError) as exc:
        # Files under /etc or the lab folder, or a daemon that would not stop: the
        # message names the path or the pid, which is what the user needs.
        raise LabError(str(exc)) from None
    return 0


if __name__ == "__main__":
    run_cli(main)
