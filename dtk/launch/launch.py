"""launch: the plan becomes running workers. The one place that chooses how."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dtk import audit
from dtk.config.compose import to_yaml
from dtk.errors import UserError
from dtk.launch import runlock
from dtk.launch.progress import Progress
from dtk.launch.runlock import RunLock
from dtk.plan.plan import Plan
from dtk.rundir import RunDir, write_json_atomic


def worker_command(plan: Plan) -> str:
    return f"{sys.executable} -m dtk.worker {plan.run_dir}"


def describe_launch(plan: Plan) -> str:
    """What a dry run prints: the sbatch script on Slurm, the worker commands locally."""
    if plan.cluster_kind == "slurm":
        from dtk.launch.sbatch import describe_submission

        return describe_submission(plan, submit_inputs(plan, RunDir(Path(plan.run_dir))))
    lines = [plan.describe(), "", f"would start {plan.world_size} worker process(es) on this machine:"]
    for rank in range(plan.world_size):
        lines.append(f"  rank {rank}: DTK_RANK={rank} DTK_WORLD_SIZE={plan.world_size} {worker_command(plan)}")
    return "\n".join(lines)


def check_run_dir(plan: Plan, run: RunDir) -> None:
    """A run directory holds one run: refuse to mix another config into it, or to start it
    over (checkpoint.resume=false) where its first save would delete committed checkpoints."""
    if not plan.config.checkpoint.resume:
        committed = [step for step, _, ok in run.checkpoint_steps() if ok]
        if committed:
            shown = ", ".join(map(str, committed[-3:]))
            raise UserError(
                f"checkpoint.resume=false: {run.path} holds committed checkpoints (step {shown}) that starting"
                " over would delete; use another run.name to start a new run, or leave checkpoint.resume"
                " unset to continue this one"
            )
    if not run.plan_json.is_file():
        return
    try:
        previous = json.loads(run.plan_json.read_text())
    except json.JSONDecodeError:
        return
    if previous.get("config_hash") != plan.config_hash:
        raise UserError(
            f"run.name={plan.run_name}: {run.path} already holds a run with another configuration"
            f" (hash {previous.get('config_hash')} vs {plan.config_hash}); choose another run.name"
            " or leave run.name unset to get one derived from the config"
        )


def check_run_root(root: Path) -> None:
    """run.root must take a run directory: tried for real (a folder made and removed where the
    first existing part of the path is), since permissions alone do not tell (root, ACLs,
    a read-only mount)."""
    import tempfile

    existing = root
    while not existing.exists():
        existing = existing.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dtk-probe-", dir=existing))
    except OSError as exc:
        raise UserError(f"run.root={root}: cannot create a run directory there ({exc.strerror or exc} in {existing});"
                        " choose a folder you can write, on storage every node sees") from None


def check_access(plan: Plan) -> None:
    """The access policy's checks (the submitter's role, the Slurm keys it fixes, the run
    root), then the umask that makes the run's files group-writable (docs/access.md)."""
    from dtk.access.check import apply_umask, check_submit

    policy = plan.config.access
    c = plan.config.cluster
    check_submit(policy, run_dir=Path(plan.run_dir), cluster_kind=plan.cluster_kind, partition=c.partition,
                 account=c.account, qos=c.qos)
    apply_umask(policy)


def check_dependencies(after: str | None, job_state) -> None:
    """Slurm counts a dependency on a job it does not know as met, and would start the job
    at once: refuse that here."""
    for job in (after or "").split(":"):
        if job and job_state(job) is None:
            raise UserError(f"submit.after={after}: Slurm knows no job {job} (neither queued nor recently ended);"
                            " a dependency on it would be met at once. Check the id with squeue")


def prepare_run_dir(plan: Plan, files: dict[str, str] | None = None) -> RunDir:
    """Write the config and plan, and `files` (name -> text: plan.md, the memory prediction);
    `launch` has already refused a directory of another run. The resolved config is
    read-only: a change to what a run computes is a new run."""
    from dtk.access.layout import write_readonly

    run = RunDir(Path(plan.run_dir))
    run.path.mkdir(parents=True, exist_ok=True)
    write_readonly(run.config_yaml, to_yaml(plan.config))
    write_json_atomic(run.plan_json, json.loads(plan.to_json()))
    for name, text in (files or {}).items():
        tmp = run.path / f".{name}.tmp{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, run.path / name)
    return run


def already_finished(plan: Plan, run: RunDir) -> bool:
    summary = run.read_summary()
    return bool(summary and summary.get("status") == "finished" and summary.get("final_step") == plan.steps)


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
    return SubmitInputs(exclude=tuple(sorted(set(read_exclusions(run)) | set(listed))), signal_lead_s=lead)


def read_exclude_file(path: str | None) -> tuple[str, ...]:
    """cluster.exclude_from: node names, one per line (`# why` after a name, or a line of
    its own, is a comment), as `python -m dtk.doctor` writes them."""
    if path is None:
        return ()
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"cluster.exclude_from={path}: cannot read it ({exc.strerror or exc}); give a file of"
                        " node names, one per line (python -m dtk.doctor writes one)") from None
    names = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    bad = [n for n in names if n and not all(c.isalnum() or c in "-_.[],"  for c in n)]
    if bad:
        raise UserError(f"cluster.exclude_from={path}: {bad[0]!r} is not a node name; one name per line")
    return tuple(n for n in names if n)


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
    check_run_root(run.path.parent)
    audit.check_writable(run.path.parent)
    if plan.cluster_kind == "slurm":
        c = plan.config.cluster
        slurmctl.check_fits(slurmctl.partitions(), partition=c.partition, nodes=plan.nodes, time_min=c.time_min,
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
    from dtk.launch.sbatch import make_executor, submitit_folder

    inputs = submit_inputs(plan, run)
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


ENDED = runlock.ENDED  # Slurm states after which the job will not run again by itself


def follow(plan: Plan, run: RunDir, job_id: str, *, slurm=None, poll_s: float = 2.0) -> int:
    """Follow a Slurm job to its end with a progress line; 0 when the run finished. A Slurm
    that does not answer for slurmctl.RETRY_S ends the wait (not the job) with an error line."""
    from dtk.launch.slurmctl import Slurm, SlurmUnavailable

    slurm = slurm or Slurm()
    state: list[str | None] = ["PENDING"]
    progress = Progress(run.metrics, total=plan.steps, every=plan.config.train.log_every,
                        state=lambda: f"job {job_id} {state[0]}")
    progress.skip_existing()
    shown = None
    while True:
        try:
            state[0] = slurm.job_state(job_id)
        except SlurmUnavailable as exc:
            print(f"error: stopped following job {job_id}, Slurm does not answer: {exc}; the job itself may"
                  f" still run: python -m dtk.status {run.path}", file=sys.stderr)
            return 1
        progress.poll()
        if state[0] != shown:
            print(f"job {job_id}: {state[0] or 'gone from the queue'}", flush=True)
            shown = state[0]
        if state[0] is None or state[0] in ENDED:
            break
        slurm.clock.sleep(poll_s)
    progress.poll(final=True)
    summary = run.read_summary() or {}
    if summary.get("status") == "finished":
        print(f"finished: {run.path} step {summary.get('final_step')} loss {summary.get('final_loss')}")
        return 0
    print(f"error: job {job_id} ended {state[0] or ''} without finishing the run: "
          f"{summary.get('error', 'no summary written')}; see python -m dtk.status {run.path}", file=sys.stderr)
    return 1
