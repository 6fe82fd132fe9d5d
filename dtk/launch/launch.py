"""launch: the checks before a run starts, its run directory, and following a Slurm job to its
end; dtk.submit.start (the one place that chooses how a run starts) calls them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dtk.common.errors import UserError
from dtk.common.rundir import RunDir, write_json_atomic
from dtk.common.storage import committed_steps, run_storage
from dtk.config.choices import TRACKER_MODULES, chosen_trackers
from dtk.config.compose import to_yaml
from dtk.config.schema import TrainConfig
from dtk.launch import nodenames, runlock
from dtk.launch.progress import Progress
from dtk.plan.plan import Plan


def worker_command(plan: Plan) -> str:
    return f"{sys.executable} -m dtk.worker {plan.run_dir}"


def check_run_dir(plan: Plan, run: RunDir) -> None:
    """A run directory holds one run: refuse to mix another config into it, or to start it
    over (checkpoint.resume=false) where its first save would delete committed checkpoints."""
    if not plan.config.checkpoint.resume:
        store = run_storage(run, plan.config.checkpoint.dir)  # RUN_DIR/checkpoints/ or the object store's
        try:
            committed = committed_steps(store)
        except OSError as exc:
            raise UserError(f"checkpoint.dir={plan.config.checkpoint.dir}: cannot list {store} to check that"
                            f" checkpoint.resume=false deletes no committed checkpoint ({exc})") from None
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


def check_trackers(train: TrainConfig) -> None:
    """A tracker whose package is not installed, found here and not in rank 0 after the queue
    wait. find_spec only: the login node imports none of them."""
    import importlib.util

    for tracker in chosen_trackers(train.tracker, tensorboard=train.tensorboard):
        module = TRACKER_MODULES[tracker]
        if importlib.util.find_spec(module) is None:
            key = "train.tensorboard=true" if tracker not in train.tracker else f"train.tracker includes {tracker}"
            raise UserError(f"{key}, but the {module} package is not installed here ({sys.executable}):"
                            f" pip install {module} (or pip install -e .[dev]), or leave {tracker} out")


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
    bad = nodenames.split(n for n in names if n)[1]  # the one node-name check
    if bad:
        raise UserError(f"cluster.exclude_from={path}: {nodenames.shown(bad[0])} is not a node name; one name per line")
    return tuple(n for n in names if n)


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
