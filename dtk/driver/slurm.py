"""The driver inside a Slurm allocation: one per job, on the batch host.

submitit runs `drive(run_dir)` once, in the batch script (`use_srun=False`). The driver
starts the worker step with srun over the allocation, waits for it, and records the
lineage of every start (job id, Slurm's restart count, node list) in events.jsonl. The
workers never requeue themselves; recovery decisions belong here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from dtk.driver.local import free_port
from dtk.driver.record import record_failure
from dtk.launch.slurmctl import expand_nodelist
from dtk.plan.plan import Plan
from dtk.rundir import RunDir
from dtk.worker.codes import EXIT_STOPPED

# Variables of the local driver that must not leak into srun tasks: the workers there read
# their rank from SLURM_PROCID (see dtk.worker.env).
_LOCAL_ONLY = ("DTK_RANK", "DTK_LOCAL_RANK", "DTK_WORLD_SIZE", "DTK_LOCAL_WORLD_SIZE", "DTK_NODE_RANK")


def srun_command(plan: Plan, *, logs: Path, nodes: list[str]) -> list[str]:
    return [
        "srun",
        f"--nodes={plan.nodes}",
        f"--ntasks={plan.world_size}",
        f"--ntasks-per-node={plan.tasks_per_node}",
        f"--nodelist={','.join(nodes[: plan.nodes])}",
        "--kill-on-bad-exit=1",  # one dead rank ends the step instead of leaving the rest hung
        "--unbuffered",
        f"--output={logs}/rank_%t.log",
        sys.executable,
        "-m",
        "dtk.worker",
        str(plan.run_dir),
    ]


def _latest_step(run: RunDir) -> int:
    complete = [step for step, _, ok in run.checkpoint_steps() if ok]
    return complete[-1] if complete else 0


def _requeue(run: RunDir, *, job_id: str, nodes: list[str], restart: int, step_at_start: int) -> int:
    """The workers saved and stopped on a signal (time limit ahead, or preemption): put the
    job back in the queue, unless this start made no progress, which would loop forever."""
    step = _latest_step(run)
    if step <= step_at_start:
        error = (
            f"job {job_id} was stopped again at step {step} without completing a step since its start;"
            " not requeued (is the time limit shorter than start-up plus a checkpoint?)"
        )
        record_failure(run, error=error, restarts=restart, job_id=job_id, step=step)
        raise RuntimeError(error)
    run.event("requeued", job_id=job_id, step=step, nodes=nodes, restart=restart)
    # A requeued job becomes PENDING again; scontrol kills this batch script while doing it.
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        record_failure(run, error=f"scontrol requeue {job_id} failed: {proc.stderr.strip()}", restarts=restart)
        raise RuntimeError(proc.stderr.strip())
    return EXIT_STOPPED


def drive(run_dir: str) -> int:
    run = RunDir(Path(run_dir))
    plan = Plan.from_json(run.plan_json.read_text())
    job_id = os.environ.get("SLURM_JOB_ID", "?")
    nodes = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
    restart = run.starts()
    logs = run.log_dir(restart)
    logs.mkdir(parents=True, exist_ok=True)
    run.event(
        "started",
        restart=restart,
        job_id=job_id,
        slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        nodes=nodes,
        world_size=plan.world_size,
        batch_host=socket.gethostname(),
    )
    env = {k: v for k, v in os.environ.items() if k not in _LOCAL_ONLY}
    env.update(
        DTK_MASTER_ADDR=nodes[0],
        # The batch host is the allocation's first node, where rank 0 runs: a port free
        # here is free for rank 0's rendezvous store.
        DTK_MASTER_PORT=str(free_port()),
        DTK_RESTART=str(restart),
        PYTHONUNBUFFERED="1",
    )
    cmd = srun_command(plan, logs=logs, nodes=nodes)
    print("driver:", " ".join(cmd), flush=True)
    step_at_start = _latest_step(run)
    code = subprocess.run(cmd, env=env).returncode
    if code == EXIT_STOPPED:
        return _requeue(run, job_id=job_id, nodes=nodes, restart=restart, step_at_start=step_at_start)
    if code != 0:
        error = f"worker step exited with code {code} in job {job_id}; logs in {logs}"
        record_failure(run, error=error, restarts=restart, job_id=job_id, exit_code=code, nodes=nodes)
        raise RuntimeError(f"worker step exited with code {code}; logs in {logs}")
    return code
