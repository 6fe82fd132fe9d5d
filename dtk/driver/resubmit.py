"""Sites whose preemption cancels (PreemptMode=CANCEL): the run goes on in a new job.

Measured on the lab (Slurm 22.05): a preemption sends the job's steps SIGTERM and sets the
job's PreemptTime; the job stays RUNNING for the partition's GraceTime, then Slurm ends it
PREEMPTED (the batch script, the driver, gets SIGTERM only then, and SIGKILL KillWait
later). With PreemptMode=REQUEUE Slurm puts such a job back in the queue; with CANCEL it is
simply gone, and no site promises that a requeue asked during the grace time holds.

So when the workers stopped on a signal (they saved: exit 3 and a `preempted` event) and
Slurm says the job is being preempted on a partition whose PreemptMode cancels, the driver
does not requeue: within the grace time it submits the same run as a new job (the same
batch script, the run's exclusions and the root's suspect nodes, `--dependency=afterany:` this job, so it starts once
this one is gone), records `resubmitted` (the new job id, the job it follows, the saved
step) and hands the run's lock to the new job. The new job's driver resumes from the saved
step like a requeued one; `python -m dtk.status RUN_DIR` lists the chain of jobs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from dtk.common import audit
from dtk.common.rundir import RunDir
from dtk.launch import reputation
from dtk.launch.nodenames import split, warning
from dtk.launch.runlock import RunLock
from dtk.launch.sbatch import SubmitInputs, make_executor
from dtk.launch.slurmctl import Slurm, parse_kv_line
from dtk.plan.plan import Plan

KEPT_ENV = ("SLURM_CONF",)
"""SLURM_* variables the new job may inherit from this one's environment (sbatch exports
the submitter's environment: this job's SLURM_RESTART_COUNT or SLURM_JOB_* would mislead
the new job's driver)."""


def preempted_cancels(slurm: Slurm, job_id: str) -> bool:
    """Is the job being preempted on a partition whose PreemptMode cancels it?"""
    info = slurm.job_info(job_id) or {}
    if info.get("PreemptTime") in (None, "", "None", "Unknown") or not info.get("Partition"):
        return False
    proc = slurm.query(["scontrol", "show", "partition", info["Partition"], "-o"])
    mode = parse_kv_line(proc.stdout).get("PreemptMode", "") if proc.returncode == 0 else ""
    return "CANCEL" in mode.upper()


@contextlib.contextmanager
def _without_job_env() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items()
             if (k.startswith(("SLURM_", "SBATCH_", "SUBMITIT_")) and k not in KEPT_ENV)}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def signal_lead_of(run: RunDir, floor_s: int) -> int:
    """The signal lead the run's latest submission chose (from what it had measured)."""
    leads = [e.get("signal_lead_s") for e in run.events_list() if e.get("event") in ("submitted", "resubmitted")]
    return int(next((v for v in reversed(leads) if isinstance(v, int)), floor_s))


def resubmit_inputs(run: RunDir, plan: Plan, job_id: str, *, exclude: list[str]) -> SubmitInputs:
    """What the new job is submitted with: `exclude` and the root's suspect nodes, each a
    valid node name (dtk/launch/nodenames.py: the others are left out with a warning),
    this run's signal lead, and `--dependency=afterany:` the job it follows."""
    suspect = reputation.suspects(run.path.parent, after=plan.config.cluster.suspect_after)  # as at any submission
    names, invalid = split(sorted(set(exclude) | set(suspect)))
    if invalid:
        print(f"driver: {warning(invalid, source='the exclusions of the resubmission')}", file=sys.stderr, flush=True)
    return SubmitInputs(exclude=tuple(names), signal_lead_s=signal_lead_of(run, plan.config.fault.signal_lead_floor_s),
                        after_job=job_id)


def resubmit(run: RunDir, plan: Plan, job_id: str, *, exclude: list[str], entry: Callable[..., int]) -> str:
    """Submit the run again as a new job that follows `job_id`; its id. `entry` is the
    driver's entry point (dtk.driver.supervisor.drive). The audit log records it."""
    inputs = resubmit_inputs(run, plan, job_id, exclude=exclude)
    with _without_job_env():
        job = make_executor(plan, inputs).submit(entry, plan.run_dir)
    with RunLock(run.path) as lock:  # the new job holds the run from now on
        lock.acquire(job_state=lambda _job: None)  # this job is its holder, ending
        lock.record(kind="slurm", job_id=job.job_id)
    audit.record_or_warn(run.path, "resubmit", job_ids=[str(job.job_id)], after_job=job_id, by="driver",
                         exclude=list(inputs.exclude))
    return str(job.job_id)
