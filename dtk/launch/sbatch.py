"""Plan -> sbatch submission through submitit.

The sbatch text is a pure function of the plan (`sbatch_text`), rendered here and checked
against golden files; the executor used for the real submission writes its script with
that same function, so a dry run prints exactly what would be submitted. dtk renders the
script itself rather than through submitit's private `_make_sbatch_string`, so a submitit
release cannot change what is submitted.

The batch script runs one process, the driver (`dtk.driver.supervisor.drive`), on the first node
of the allocation (submitit's `use_srun=False`); the driver starts the worker step with srun
and supervises it. submitit still expects one result per task, so nobody waits on
`job.results()`: job state comes from squeue/scontrol and the run directory.
"""

from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.common.resources import templates_dir
from dtk.launch.nodenames import is_node_name, shown
from dtk.plan.plan import Plan

SETUP_DIR = templates_dir() / "setup"
# Seconds added to the measured save + step time when choosing the signal lead: slack for
# the signal's delivery and the agreement at the next step boundary.
SIGNAL_MARGIN_S = 30


@dataclass(frozen=True)
class SubmitInputs:
    """What a submission takes from the run directory besides the plan."""

    exclude: tuple[str, ...] = ()
    signal_lead_s: int = 60
    """USR2 this many seconds before the time limit: the workers save and the job requeues."""
    after_job: str | None = None
    """A job of the same run that must end first (sbatch --dependency=afterany): the driver's
    resubmission when a preemption cancels its job (PreemptMode=CANCEL)."""
    note: str = ""
    """What the submission prints about `exclude`, a line each: suspect nodes left out
    (dtk/launch/reputation.py), invalid node names ignored (dtk/launch/nodenames.py)."""


def signal_lead(*, floor_s: int, save_s: float | None, step_s: float | None) -> int:
    """Lead time of the pre-time-limit signal: a save plus a step plus a margin, measured on
    this run's earlier starts; the configured floor until there is something to measure."""
    if save_s is None or step_s is None:
        return floor_s
    return max(floor_s, math.ceil(save_s + step_s + SIGNAL_MARGIN_S))


def submitit_folder(plan: Plan) -> Path:
    log_dir = plan.config.cluster.log_dir
    return Path(log_dir) if log_dir else Path(plan.run_dir) / "slurm"


def setup_lines(names: list[str]) -> list[str]:
    lines: list[str] = []
    for name in names:
        path = SETUP_DIR / f"{name}.sh"
        if not path.is_file():
            available = sorted(p.stem for p in SETUP_DIR.glob("*.sh"))
            raise UserError(f"cluster.setup: no slurm_templates/setup/{name}.sh (available: {', '.join(available)})")
        lines += [f"# from slurm_templates/setup/{name}.sh"] + [
            ln for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")
        ]
    return lines


def parse_extra(flags: list[str]) -> dict[str, Any]:
    """`--reservation=big` / `--mail-type END` -> {"reservation": "big", ...} for submitit."""
    out: dict[str, Any] = {}
    for flag in flags:
        if not flag.startswith("--"):
            raise UserError(f"cluster.sbatch_extra: {flag!r} is not a long sbatch flag (expected like --reservation=NAME)")
        key, sep, value = flag[2:].partition("=")
        if not sep:
            key, _, value = key.partition(" ")
        out[key.strip()] = value.strip() if value.strip() else True
    return out


def sbatch_flags(plan: Plan, inputs: SubmitInputs = SubmitInputs()) -> dict[str, str | bool]:
    """The `#SBATCH` flags of this plan: name -> value (True for a flag without one)."""
    c = plan.config.cluster
    folder = submitit_folder(plan) / "%j"
    if "\n" in str(folder):  # it would end its #SBATCH line
        raise UserError(f"run.root={plan.config.run.root}: the job's folder {str(folder)!r} has a newline"
                        " in its path, which sbatch cannot take; choose a run.root (or cluster.log_dir) without one")
    flags: dict[str, str | bool] = {
        "job-name": f"dtk-{plan.run_name}",
        "nodes": str(plan.nodes + plan.spare_nodes),
        "ntasks-per-node": str(plan.tasks_per_node),
        "cpus-per-task": str(c.cpus_per_task),
        "time": str(c.time_min),
        # USR2 (not USR1, which NCCL may use) to the job steps, i.e. the workers, ahead of
        # the time limit: they agree at a step boundary, save, and the driver requeues.
        "signal": f"USR2@{inputs.signal_lead_s}",
        # Where submitit's entry point (`submit_command`) logs: the driver's output.
        "output": f"{folder}/%j_0_log.out",
        "open-mode": "append",
        # Requeue: a preemption or a requeue by the driver puts the job back in the queue,
        # where it finds its run directory (identity comes from the config) and resumes.
        "requeue": True,
    }
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(c, key):
            flags[key] = getattr(c, key)
    if c.gpus_per_node:
        flags["gpus-per-node"] = str(c.gpus_per_node)
    if c.mem_gb:
        flags["mem"] = f"{c.mem_gb}GB"
    if c.exclusive:
        flags["exclusive"] = True
    if inputs.exclude:
        # Every source left its invalid names out already (dtk/launch/nodenames.py); one
        # that did not is a bug, never a line of the script.
        bad = [n for n in inputs.exclude if not is_node_name(n)]
        assert not bad, f"invalid node name(s) reached the sbatch --exclude: {', '.join(map(shown, bad))}"
        flags["exclude"] = ",".join(inputs.exclude)
    if plan.config.submit.after:
        # A job this one depends on: it stays pending until that one completed successfully
        # (a job that requeues itself keeps its id, so a requeue is no success yet).
        flags["dependency"] = f"afterok:{plan.config.submit.after}"
    if inputs.after_job:
        # The same run's job that a preemption cancels: this one starts once it is gone
        # (and with it the driver that submitted this), whatever it ended as.
        flags["dependency"] = f"afterany:{inputs.after_job}"
    if plan.config.fault.survive_node_loss:
        flags["no-kill"] = True  # a failed node ends the worker step, not the job: the driver goes on
    return {**flags, **parse_extra(c.sbatch_extra)}


def submit_command(folder: Path, python: str = sys.executable) -> str:
    """The command at the end of the script: submitit's entry point unpickles and runs the
    driver (`dtk.driver.supervisor.drive`), once, on the batch host."""
    return f"{shlex.quote(python)} -u -m submitit.core._submit {shlex.quote(str(folder))}"


LINE_BREAKS = ("\n", "\r", "\0")
"""What no `#SBATCH` line may hold: a `#SBATCH` line is a shell comment, and quoting does not
keep a newline from ending it (the rest would run as a command, and sbatch would ignore
every later `#SBATCH` line); a NUL ends the text where C reads it."""


def check_flag(name: str, value: str | bool) -> None:
    """A UserError naming the flag when its name or value would break its `#SBATCH` line."""
    for text in (name, "" if value is True else str(value)):
        if any(c in text for c in LINE_BREAKS):
            raise UserError(f"sbatch --{shown(name)}={shown(str(value))}: a newline, carriage return or NUL cannot be"
                            " part of a #SBATCH line; give the value on one line without control characters")


def render_sbatch(flags: dict[str, str | bool], *, setup: list[str], command: str) -> str:
    """A batch script: flags sorted by name, each value shell-quoted (sbatch reads `#SBATCH`
    values with the shell's quoting rules, so a path with spaces or quotes survives), then
    the setup lines and the command. A flag with a line break or a NUL is refused (`check_flag`)."""
    lines = ["#!/bin/bash", "", "# Parameters"]
    for name in sorted(flags):
        value = flags[name]
        check_flag(name, value)
        lines.append(f"#SBATCH --{name}" if value is True else f"#SBATCH --{name}={shlex.quote(str(value))}")
    lines += ["", "# setup", *setup, "", "# command", "export SUBMITIT_EXECUTOR=slurm", command, ""]
    return "\n".join(lines)


def sbatch_text(plan: Plan, inputs: SubmitInputs = SubmitInputs(), *, command: str | None = None) -> str:
    """The whole sbatch script: a pure function of the plan and the submission inputs.
    `command` defaults to what submitit's executor passes."""
    setup = setup_lines(plan.config.cluster.setup) + [f"export DTK_RUN_DIR={shlex.quote(plan.run_dir)}"]
    command = command or submit_command(submitit_folder(plan) / "%j")
    return render_sbatch(sbatch_flags(plan, inputs), setup=setup, command=command)


def describe_submission(plan: Plan, inputs: SubmitInputs = SubmitInputs()) -> str:
    return "\n".join([plan.describe(), "", "would submit this sbatch script:", "", sbatch_text(plan, inputs)])


def make_executor(plan: Plan, inputs: SubmitInputs = SubmitInputs()):
    """The one place that builds the Slurm executor. The script is dtk's own (`sbatch_text`);
    submitit pickles the driver call, runs sbatch and parses the job id. Its parameters
    below only keep its bookkeeping (tasks per job, time) in line with the script."""
    from submitit import SlurmExecutor

    class DtkSlurmExecutor(SlurmExecutor):
        # The hook every submitit executor implements (PicklingExecutor's abstract method).
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return sbatch_text(plan, inputs, command=command)

    executor = DtkSlurmExecutor(folder=submitit_folder(plan) / "%j", max_num_timeout=0)
    executor.update_parameters(nodes=plan.nodes + plan.spare_nodes, ntasks_per_node=plan.tasks_per_node,
                               time=plan.config.cluster.time_min)
    return executor
