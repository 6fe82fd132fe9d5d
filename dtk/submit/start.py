"""Start a planned run: on the local cluster the driver runs in this process; on Slurm the
job runs the driver (`drive`, handed to submitit). The one place the login-node launch
(dtk.launch: checks, the sbatch text, Slurm queries) meets the driver (dtk.driver), so
that the driver can use the launch's Slurm layer without a cycle between the two."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dtk.common import audit
from dtk.common.errors import UserError
from dtk.common.rundir import RunDir
from dtk.launch import reputation
from dtk.launch.launch import (
    already_finished,
    check_access,
    check_dependencies,
    check_run_dir,
    check_run_root,
    follow,
    prepare_run_dir,
    read_exclude_file,
    worker_command,
)
from dtk.launch.progress import Progress
from dtk.launch.runlock import RunLock
from dtk.plan.plan import Plan


def describe_launch(plan: Plan) -> str:
    """What a dry run prints: the sbatch script on Slurm, the worker commands locally."""
    if plan.cluster_kind == "slurm":
        from dtk.launch.sbatch import describe_submission

        inputs = submit_inputs(plan, RunDir(Path(plan.run_dir)))
        return "\n".join(([inputs.note] if inputs.note else []) + [describe_submission(plan, inputs)])
    lines = [plan.describe(), "", f"would start {plan.world_size} worker process(es) on this machine:"]
    for rank in range(plan.world_size):
        lines.append(f"  rank {rank}: DTK_RANK={rank} DTK_WORLD_SIZE={plan.world_size} {worker_command(plan)}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Launched:
    code: int  # exit code for the submitting command
    job_id: str | None = None


def launch(plan: Plan, files: dict[str, str] | None = None) -> Launched:
    """Launch the plan on its cluster; `files` are written into the run directory with the plan."""
    run = RunDir(Path(plan.run_dir))
    from dtk.launch import slurmctl

    check_access(plan)  # first: an outsider may not even look into the run root
    check_run_dir(plan, run)
    from dtk.common.storage import check_location  # torch-free; s3fs is not imported

    ckpt = plan.config.checkpoint
    check_location(ckpt.dir, async_save=ckpt.async_save, async_mode=ckpt.async_mode)
    check_run_root(run.path.parent)
    audit.check_writable(run.path.parent)
    if plan.cluster_kind == "slurm":
        from dtk.access.check import check_admitted

        c = plan.config.cluster
        read_exclude_file(c.exclude_from)  # a file on this host: refused before Slurm is asked anything
        parts = slurmctl.partitions()
        check_admitted(parts, partition=c.partition, policy=plan.config.access)
        slurmctl.check_fits(parts, partition=c.partition, nodes=plan.nodes, time_min=c.time_min,
                            spare_nodes=plan.spare_nodes)
        check_dependencies(plan.config.submit.after, slurmctl.job_state)
    created = _first_missing(run.path)  # what a refused launch removes again
    # One writer per run directory: held until the local driver ends, or recorded as the
    # Slurm job's once it is queued (dtk.launch.runlock).
    with RunLock(run.path) as lock:
        try:
            lock.acquire(job_state=slurmctl.job_state)
            check_run_dir(plan, run)  # again under the lock: the holder may have written since
            if already_finished(plan, run):
                summary = run.read_summary() or {}
                print(f"run {plan.run_name} already finished ({run.path}: step {summary.get('final_step')},"
                      f" loss {summary.get('final_loss')}); nothing submitted. The same config is the same run;"
                      f" to start another, give it a name of its own: run.name={plan.run_name}-2")
                return Launched(0)
            print(plan.describe(), flush=True)
            if plan.cluster_kind == "slurm":
                return _launch_slurm(plan, run, lock=lock, created=created, files=files)
            return Launched(_launch_local(plan, lock=lock, files=files))
        except UserError:
            if created is not None:  # a refused launch leaves no run behind
                shutil.rmtree(created, ignore_errors=True)
            raise


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (None: it all exists)."""
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing


def _launch_local(plan: Plan, *, lock: RunLock, files: dict[str, str] | None = None) -> int:
    run = prepare_run_dir(plan, files)
    lock.record(kind="local", job_id=f"local-{os.getpid()}")
    run.event("submitted", cluster="local", world_size=plan.world_size, scheme=plan.scheme)
    audit.record(run.path.parent, "submit", run=plan.run_name, config_hash=plan.config_hash,
                 job_ids=[f"local-{os.getpid()}"], cluster="local")
    from dtk.driver.local import LocalDriver

    progress = Progress(run.metrics, total=plan.steps, every=plan.config.train.log_every)
    progress.skip_existing()
    code = LocalDriver(plan, run, progress=progress, lock_fd=lock.fileno()).run_to_end()
    if code == 0:
        summary = run.read_summary() or {}
        print(f"finished: {run.path} step {summary.get('final_step')} loss {summary.get('final_loss')}")
    return code


def _launch_slurm(plan: Plan, run: RunDir, *, lock: RunLock, created: Path | None,
                  files: dict[str, str] | None = None) -> Launched:
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    from dtk.driver.supervisor import drive
    from dtk.launch.sbatch import make_executor, sbatch_text, submitit_folder

    inputs = submit_inputs(plan, run)
    sbatch_text(plan, inputs)  # a flag the script cannot hold is refused before anything is written
    if inputs.note:
        print(inputs.note, flush=True)
    run = prepare_run_dir(plan, files)
    sbatch_stderr = io.StringIO()  # submitit echoes sbatch's stderr; it belongs in our one error line
    try:
        with contextlib.redirect_stderr(sbatch_stderr):
            job = make_executor(plan, inputs).submit(drive, plan.run_dir)
    except (FailedJobError, FailedSubmissionError, subprocess.CalledProcessError) as exc:
        if created is not None:  # nothing half-written: a refused job leaves no run behind
            shutil.rmtree(created, ignore_errors=True)
        said = sbatch_stderr.getvalue().strip() or str(getattr(exc, "stderr", "") or exc)
        detail = " ".join(said.replace("sbatch: error:", "").split())
        raise UserError(f"sbatch refused the job: {detail}") from None
    lock.record(kind="slurm", job_id=job.job_id)
    run.event("submitted", cluster="slurm", job_id=job.job_id, world_size=plan.world_size, scheme=plan.scheme,
              signal_lead_s=inputs.signal_lead_s, exclude=list(inputs.exclude))
    audit.record(run.path.parent, "submit", run=plan.run_name, config_hash=plan.config_hash,
                 job_ids=[job.job_id], cluster="slurm")
    log = submitit_folder(plan) / job.job_id / f"{job.job_id}_0_log.out"
    print(f"submitted job {job.job_id}\n  run dir  {run.path}\n  log      {log}\n"
          f"  status   python -m dtk.status {run.path}", flush=True)
    wait = plan.config.submit.wait
    if not wait:
        return Launched(0, job.job_id)
    return Launched(follow(plan, run, job.job_id), job.job_id)


def submit_inputs(plan: Plan, run: RunDir):
    """Exclusions and the signal lead time, from what this run recorded so far."""
    import statistics

    from dtk.driver.exclusions import read_exclusions
    from dtk.launch.sbatch import SubmitInputs, signal_lead

    saves = [e["seconds"] for e in run.events_list() if e.get("event") == "checkpoint_saved" and "seconds" in e]
    steps = [r["step_time_s"] for r in run.latest_metrics().values() if "step_time_s" in r]
    lead = signal_lead(
        floor_s=plan.config.fault.signal_lead_floor_s,
        save_s=max(saves) if saves else None,
        step_s=statistics.median(steps) if steps else None,
    )
    listed = read_exclude_file(plan.config.cluster.exclude_from)
    root, after = run.path.parent, plan.config.cluster.suspect_after
    suspect = reputation.suspects(root, after=after)
    # Every name passed the node-name check (dtk/launch/nodenames.py); the ones that did
    # not are said here, escaped, and left out.
    invalid = reputation.invalid_of(reputation.exclusions_under(root))
    notes = ([reputation.submission_line(suspect, root=root, after=after)] if suspect else []) + (
        [reputation.invalid_line(invalid, root=root)] if invalid else [])
    return SubmitInputs(exclude=tuple(sorted(set(read_exclusions(run)) | set(listed) | set(suspect))),
                        signal_lead_s=lead, note="\n".join(notes))
