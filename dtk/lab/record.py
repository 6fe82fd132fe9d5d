"""The lab's record: what `up` started and who asked, kept in the lab directory for
`status` and `down` (and for a later `up`, which must know which processes are its own)."""

from __future__ import annotations

import json
import os
import pwd
import socket
import time
from dataclasses import dataclass

from dtk.lab.daemons import Daemon
from dtk.lab.files import LabLayout


@dataclass(frozen=True)
class LabRecord:
    """What `up` started, as written to the lab directory."""

    num_nodes: int
    daemons: tuple[Daemon, ...] = ()
    started_by: str = ""
    """The user who ran `up` (the one behind sudo, when it was sudo)."""
    started_at: float = 0.0
    host: str = ""
    netns: bool = False
    """Each node in a network namespace of its own (`up --netns`, dtk.lab.netns)."""
    slow: tuple[tuple[str, str], ...] = ()
    """(node, rate) of every node whose sending `dtk.lab slow` limits."""
    num_gpus: int = 0
    """GPUs Slurm schedules on each node (`up --gpus-per-node`, dtk.lab.gres)."""
    preempt_mode: str = "requeue"
    """What a preemption does to a job in `debug` (`up --preempt-mode`): requeue or cancel."""

    def to_json(self) -> str:
        return json.dumps({"num_nodes": self.num_nodes, "daemons": [d.to_json() for d in self.daemons],
                           "started_by": self.started_by, "started_at": self.started_at, "host": self.host,
                           "netns": self.netns, "slow": dict(self.slow),
                           "num_gpus": self.num_gpus, "preempt_mode": self.preempt_mode}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> LabRecord:
        data = json.loads(text)
        return cls(int(data["num_nodes"]), tuple(Daemon.from_json(d) for d in data["daemons"]),
                   started_by=data.get("started_by", ""), started_at=float(data.get("started_at", 0.0)),
                   host=data.get("host", ""), netns=bool(data.get("netns", False)),
                   slow=tuple(sorted(data.get("slow", {}).items())),
                   num_gpus=int(data.get("num_gpus", 0)), preempt_mode=data.get("preempt_mode", "requeue"))

    @classmethod
    def new(cls, num_nodes: int, *, netns: bool = False, num_gpus: int = 0, preempt_mode: str = "requeue") -> LabRecord:
        return cls(num_nodes, (), started_by=invoking_user(), started_at=round(time.time(), 3),
                   host=socket.gethostname(), netns=netns, num_gpus=num_gpus, preempt_mode=preempt_mode)


def invoking_user() -> str:
    """`alice` for `sudo python -m dtk.lab up` typed by alice; the effective user otherwise."""
    sudo_user = os.environ.get("SUDO_USER")
    if sudo_user:
        return sudo_user
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def read_record(layout: LabLayout) -> LabRecord | None:
    try:
        return LabRecord.from_json(layout.record.read_text())
    except FileNotFoundError:
        return None


def write_record(layout: LabLayout, record: LabRecord) -> None:
    tmp = layout.record.with_suffix(".tmp")
    tmp.write_text(record.to_json())
    tmp.replace(layout.record)
