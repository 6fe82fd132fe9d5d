"""launch: the plan becomes running workers. The one place that chooses how."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dtk.config.compose import to_yaml
from dtk.errors import UserError
from dtk.launch.progress import Progress
from dtk.plan.plan import Plan
from dtk.rundir import RunDir, write_json_atomic


def worker_command(plan: Plan) -> str:
    return f"{sys.executable} -m dtk.worker {plan.run_dir}"


def describe_launch(plan: Plan) -> str:
    """What a dry run prints for the local cluster."""
    lines = [plan.describe(), "", f"would start {plan.world_size} worker process(es) on this machine:"]
    for rank in range(plan.world_size):
        lines.append(f"  rank {rank}: DTK_RANK={rank} DTK_WORLD_SIZE={plan.world_size} {worker_command(plan)}")
    return "\n".join(lines)


def check_run_dir(plan: Plan, run: RunDir) -> None:
    """A run directory holds one run: refuse to mix another config into it."""
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


def prepare_run_dir(plan: Plan) -> RunDir:
    run = RunDir(Path(plan.run_dir))
    check_run_dir(plan, run)
    run.path.mkdir(parents=True, exist_ok=True)
    run.config_yaml.write_text(to_yaml(plan.config))
    write_json_atomic(run.plan_json, json.loads(plan.to_json()))
    return run


def already_finished(plan: Plan, run: RunDir) -> bool:
    summary = run.read_summary()
    return bool(summary and summary.get("status") == "finished" and summary.get("final_step") == plan.steps)


def launch(plan: Plan) -> int:
    """Launch the plan; returns the exit code of the submitting command."""
    if plan.cluster_kind != "local":
        raise UserError(f"cluster.kind={plan.cluster_kind}: Slurm submission is not available in this version; use cluster=local")
    run = RunDir(Path(plan.run_dir))
    check_run_dir(plan, run)
    if already_finished(plan, run):
        summary = run.read_summary() or {}
        print(f"run {run.path} already finished: step {summary.get('final_step')}, loss {summary.get('final_loss')}")
        return 0
    run = prepare_run_dir(plan)
    run.event("submitted", cluster="local", world_size=plan.world_size, scheme=plan.scheme)
    print(plan.describe(), flush=True)
    from dtk.driver.local import LocalDriver

    progress = Progress(run.metrics, total=plan.steps, every=plan.config["train"]["log_every"])
    progress.skip_existing()
    code = LocalDriver(plan, run, progress=progress).run_to_end()
    if code == 0:
        summary = run.read_summary() or {}
        print(f"finished: {run.path} step {summary.get('final_step')} loss {summary.get('final_loss')}")
    return code
