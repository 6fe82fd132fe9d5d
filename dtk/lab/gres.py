"""GPUs for the lab: nodes that Slurm schedules GPUs on, without a GPU in the machine.

`python -m dtk.lab up --gpus-per-node 8` declares each node with `Gres=gpu:8` and two
sockets, and writes a gres.conf whose File= lines name device nodes the lab creates in
its own folder (character devices with NVIDIA's major number, 195: nothing behind them,
but Slurm only needs a file per GPU to hand out). GPUs 0..G/2-1 sit on the cores of
socket 0, the rest on socket 1, as on a DGX/HGX. srun then binds GPUs to tasks with
Slurm's own logic, and each task gets the CUDA_VISIBLE_DEVICES and SLURM_* variables a
real GPU node would give it; workers there train on the CPU (`dist.device=cpu`).

Slurm reads gres.conf from the folder of slurm.conf, so it goes to /etc/slurm/gres.conf,
under the same header rule as slurm.conf (written only where absent or dtk's own).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

NVIDIA_MAJOR = 195  # the character-device major number of /dev/nvidiaN
MAX_GPUS_PER_NODE = 16


@dataclass(frozen=True)
class NodeShape:
    """What one lab node declares: its sockets and cores, and the GPUs on each socket."""

    gpus: int
    sockets: int
    cores_per_socket: int

    @property
    def cpus(self) -> int:
        return self.sockets * self.cores_per_socket

    def socket_gpus(self, socket: int) -> range:
        per = self.gpus // self.sockets
        return range(socket * per, (socket + 1) * per)

    def socket_cores(self, socket: int) -> range:
        return range(socket * self.cores_per_socket, (socket + 1) * self.cores_per_socket)

    def resources(self, cpus_without_gpus: int) -> str:
        """The node line's resource fields. With GPUs: two sockets and a core per GPU at
        least, so that one task per GPU fits (the machine's real cores do not matter:
        slurmd trusts the config, SlurmdParameters=config_overrides)."""
        if not self.gpus:
            return f"CPUs={cpus_without_gpus}"
        return (f"Sockets={self.sockets} CoresPerSocket={self.cores_per_socket} ThreadsPerCore=1"
                f" Gres=gpu:{self.gpus}")


def node_shape(gpus: int, cpus_without_gpus: int) -> NodeShape:
    """Two sockets with half the GPUs each (one socket for a single GPU), and as many cores
    per socket as it has GPUs, at least the CPU lab's count spread over the sockets."""
    if not 0 <= gpus <= MAX_GPUS_PER_NODE or (gpus > 1 and gpus % 2):
        raise ValueError(f"gpus per node {gpus}: the lab takes 0, 1 or an even count up to {MAX_GPUS_PER_NODE}")
    sockets = 2 if gpus >= 2 else 1
    cores = max(gpus // sockets, -(-cpus_without_gpus // sockets))
    return NodeShape(gpus=gpus, sockets=sockets, cores_per_socket=cores)


def device_dir(lab_root: Path) -> Path:
    return lab_root / "dev"


def device_path(lab_root: Path, index: int) -> Path:
    return device_dir(lab_root) / f"nvidia{index}"


def render_gres_conf(header: str, *, lab_root: Path, nodes: str, shape: NodeShape) -> str:
    """gres.conf: no autodetection (there is no NVML), and one line per socket naming
    its GPUs' device files and the cores closest to them."""
    lines = [header, "# The lab's GPUs (python -m dtk.lab up --gpus-per-node N): device files in the lab folder.",
             "AutoDetect=off"]
    if shape.gpus:
        for socket in range(shape.sockets):
            gpus, cores = shape.socket_gpus(socket), shape.socket_cores(socket)
            files = f"{device_dir(lab_root)}/nvidia[{gpus[0]}-{gpus[-1]}]" if len(gpus) > 1 \
                else str(device_path(lab_root, gpus[0]))
            lines.append(f"NodeName={nodes} Name=gpu File={files} Cores={cores[0]}-{cores[-1]}")
    return "\n".join(lines) + "\n"


def make_devices(lab_root: Path, gpus: int) -> list[Path]:
    """The lab's GPU device files, fresh: character devices where the machine lets root
    make them (mknod), plain empty files where it does not (a container without
    CAP_MKNOD); Slurm hands out either."""
    folder = device_dir(lab_root)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("nvidia*"):
        old.unlink()
    made = []
    for index in range(gpus):
        path = device_path(lab_root, index)
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, index))
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EACCES, errno.EROFS):
                raise
            path.touch(mode=0o666)
        made.append(path)
    return made
