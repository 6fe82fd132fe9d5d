"""The jobs on the lab: who runs what, for `status`, and what `down` would kill.

The lab is shared: several people (and test sessions) submit to it. A job's run
directory is read from its batch script (dtk's scripts export DTK_RUN_DIR), which Slurm
shows to root and to the job's owner; others see the job name, `dtk-<run.name>`.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

SQUEUE_FORMAT = "%i|%u|%T|%N|%j"  # the name last: it may hold a `|`
# States in which a job still holds or waits for lab nodes; squeue lists no others.
WAITING = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")

Slurm = Callable[[list[str]], subprocess.CompletedProcess]


@dataclass(frozen=True)
class LabJob:
    job_id: str
    user: str
    state: str
    nodes: str
    name: str
    run_dir: str | None = None

    @property
    def running(self) -> bool:
        return self.state not in WAITING

    def line(self) -> str:
        run = self.run_dir or "-"
        return f"{self.job_id:<8} {self.user:<10} {self.state:<11} {self.nodes or '-':<12} {self.name}  (run {run})"

    def short(self) -> str:
        """`12 (bob, RUNNING, run /home/bob/runs/x)`, for one-line messages."""
        where = f", run {self.run_dir}" if self.run_dir else f", {self.name}"
        return f"{self.job_id} ({self.user}, {self.state}{where})"


def parse_squeue(text: str) -> list[LabJob]:
    jobs = []
    for line in text.splitlines():
        parts = line.split("|", 4)
        if len(parts) == 5:
            job_id, user, state, nodes, name = (p.strip() for p in parts)
            jobs.append(LabJob(job_id, user, state, nodes, name))
    return jobs


def run_dir_in_script(script: str) -> str | None:
    """The value of `export DTK_RUN_DIR=...` in a batch script, as the shell reads it."""
    for line in script.splitlines():
        if line.startswith("export DTK_RUN_DIR="):
            try:
                words = shlex.split(line.removeprefix("export "))
            except ValueError:
                return None
            return words[0].partition("=")[2] if words else None
    return None


def lab_jobs(slurm: Slurm) -> list[LabJob] | None:
    """Every job the lab's controller knows that has not ended; None when it does not answer."""
    listed = slurm(["squeue", "-h", "-a", "-o", SQUEUE_FORMAT])
    if listed.returncode != 0:
        return None
    jobs = []
    for job in parse_squeue(listed.stdout):
        script = slurm(["scontrol", "write", "batch_script", job.job_id.split("_")[0], "-"])
        run_dir = run_dir_in_script(script.stdout) if script.returncode == 0 else None
        jobs.append(LabJob(job.job_id, job.user, job.state, job.nodes, job.name, run_dir))
    return jobs
