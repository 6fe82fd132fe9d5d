"""The driver inside a Slurm allocation: one per job, on the batch host.

submitit runs `drive(run_dir)` once, in the batch script (`use_srun=False`). The driver
starts the worker step with srun, watches it (exit code, and the heartbeat rank 0 beats
every step) and owns every recovery decision; workers never requeue themselves.

    step ends              driver does
    ---------------------  -----------------------------------------------------------
    exit 0                 done (the workers wrote summary.json)
    exit 3 (stopped)       the workers saved on a signal (time limit ahead, preemption):
                           requeue the job, unless this start made no progress
    a node left the job    record and exclude it; relaunch on the nodes left (spares
                           first, else fewer nodes with the same global batch); requeue
                           with the exclusion when too few are left
    other exit / no beat   crash or hang: relaunch from the last verified checkpoint, up
                           to fault.max_restarts times, then fail with the cause
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dtk.driver.exclusions import add_exclusions, read_exclusions
from dtk.driver.local import free_port
from dtk.driver.logs import failure_cause
from dtk.driver.record import record_failure
from dtk.driver.resize import fit_plan
from dtk.launch import slurmctl
from dtk.plan.plan import Plan
from dtk.rundir import HEARTBEAT, RunDir
from dtk.worker.codes import EXIT_STOPPED
from dtk.worker.env import ENV_TABLES, driver_env

POLL_S = 0.5
KILL_WAIT_S = 30.0
# Variables of the local driver that must not leak into srun tasks: the workers there read
# their rank from SLURM_PROCID (see dtk.worker.env).
_LOCAL_ONLY = tuple(ENV_TABLES["dtk"].values())  # rank variables of the local driver; srun sets Slurm's


@dataclass
class Outcome:
    kind: str  # finished | stopped | node_failed | crashed | hung
    code: int | None = None
    lost: list[str] = field(default_factory=list)
    cause: str = ""
    detected_at: float = 0.0


def srun_command(plan: Plan, *, logs: Path, nodes: list[str]) -> list[str]:
    return [
        "srun",
        f"--nodes={plan.nodes}",
        f"--ntasks={plan.world_size}",
        f"--ntasks-per-node={plan.tasks_per_node}",
        f"--nodelist={','.join(nodes)}",
        "--kill-on-bad-exit=1",  # one dead rank ends the step instead of leaving the rest hung
        "--unbuffered",
        f"--output={logs}/rank_%t.log",
        sys.executable,
        "-m",
        "dtk.worker",
        str(plan.run_dir),
    ]


def latest_checkpoint_step(run: RunDir) -> int:
    complete = [step for step, _, ok in run.checkpoint_steps() if ok]
    return complete[-1] if complete else 0


class Supervisor:
    def __init__(self, run: RunDir, plan: Plan, job_id: str) -> None:
        self.run = run
        self.plan = plan
        self.job_id = job_id
        self.fault = plan.config.fault
        self.relaunches = 0  # after crashes and hangs, in this allocation
        self.signalled = 0  # SIGTERM (preemption) or USR2 seen by the driver itself

    def _note_signal(self, signum: int, _frame) -> None:
        # Replaces submitit's handlers in this process: USR2 there would end the driver,
        # and deciding what a signal means is the driver's job. The workers got their own.
        self.signalled = signum

    # --- Slurm facts -------------------------------------------------------------------
    def allocation(self) -> list[str]:
        """Nodes the job holds now; with --no-kill a failed node drops out of this list."""
        proc = subprocess.run(["scontrol", "show", "job", self.job_id, "-o"], capture_output=True, text=True)
        nodelist = slurmctl.parse_kv_line(proc.stdout).get("NodeList") if proc.returncode == 0 else None
        if not nodelist or nodelist == "(null)":
            return slurmctl.expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
        return slurmctl.expand_nodelist(nodelist)

    def _kill_step(self, proc: subprocess.Popen) -> None:
        steps = subprocess.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i"], capture_output=True, text=True)
        for step in steps.stdout.split():
            if step.split(".")[-1].isdigit():
                subprocess.run(["scancel", "--signal=KILL", step], capture_output=True)
        try:
            proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # --- one start ---------------------------------------------------------------------
    def start(self, plan: Plan, nodes: list[str], recovery_from: float) -> Outcome:
        restart = self.run.starts()
        logs = self.run.log_dir(restart)
        logs.mkdir(parents=True, exist_ok=True)
        plan_file = logs / "plan.json"
        plan_file.write_text(plan.to_json())
        self.run.event(
            "started",
            restart=restart,
            job_id=self.job_id,
            slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            nodes=nodes,
            world_size=plan.world_size,
            batch_host=socket.gethostname(),
        )
        env = {k: v for k, v in os.environ.items() if k not in _LOCAL_ONLY}
        env.update(
            # The batch host is the allocation's first node; a port free here is free for
            # rank 0's rendezvous store on the lab and on clusters that place rank 0 here.
            driver_env(master_addr=nodes[0], master_port=free_port(), restart=restart, plan=plan_file,
                       recovery_from=recovery_from),
            PYTHONUNBUFFERED="1",
        )
        cmd = srun_command(plan, logs=logs, nodes=nodes)
        print("driver:", " ".join(cmd), flush=True)
        started = time.time()
        proc = subprocess.Popen(cmd, env=env)
        heartbeat = self.run.path / HEARTBEAT
        while proc.poll() is None:
            time.sleep(POLL_S)
            try:
                beat = heartbeat.stat().st_mtime
            except FileNotFoundError:
                beat = 0.0
            now = time.time()
            if beat < started:
                silent, limit = now - started, self.fault.startup_timeout_s
            else:
                silent, limit = now - beat, self.fault.hang_timeout_s
            if silent > limit and proc.poll() is None:
                done = self.run.latest_metrics()
                self.run.event("hang_detected", job_id=self.job_id, nodes=nodes, step=max(done) if done else 0,
                               silent_s=round(silent, 1), limit_s=limit)
                self._kill_step(proc)
                return Outcome("hung", cause=f"no heartbeat for {silent:.0f} s (limit {limit} s)", detected_at=now)
        code = proc.returncode
        detected = time.time()
        if code == 0:
            return Outcome("finished", code)
        # Preemption signals srun too, so its exit code may say "terminated" although the
        # workers agreed, saved and stopped: their `preempted` event is what counts.
        stopped_by_workers = any(e.get("event") == "preempted" and e["time"] >= started for e in self.run.events_list())
        if code == EXIT_STOPPED or stopped_by_workers or self.signalled:
            return Outcome("stopped", code, detected_at=detected)
        left = set(self.allocation())
        lost = [n for n in nodes if n not in left]
        if lost:
            return Outcome("node_failed", code, lost=lost, cause=f"node(s) {','.join(lost)} left the job", detected_at=detected)
        return Outcome("crashed", code, cause=failure_cause(logs, code), detected_at=detected)

    # --- the loop ------------------------------------------------------------------------
    def drive(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGUSR2):
            signal.signal(sig, self._note_signal)
        recovery_from = self._recovery_from_previous_job()
        while True:
            excluded = set(read_exclusions(self.run))
            usable = [n for n in self.allocation() if n not in excluded]
            plan = fit_plan(self.plan, len(usable), allow_shrink=self.fault.shrink)
            if plan is None:
                return self._requeue(
                    reason=f"{len(usable)} usable node(s) left, {self.plan.nodes} needed", exclude=sorted(excluded),
                    detected_at=recovery_from, check_progress=False,
                )
            step_at_start = latest_checkpoint_step(self.run)
            outcome = self.start(plan, usable[: plan.nodes], recovery_from)
            if outcome.kind == "finished":
                return 0
            if outcome.kind == "stopped":
                return self._requeue(reason="stopped on a signal", exclude=sorted(excluded),
                                     detected_at=self._last_event_time("preempted"), step_at_start=step_at_start)
            recovery_from = outcome.detected_at
            done = self.run.latest_metrics()
            step = max(done) if done else 0
            if outcome.kind == "node_failed":
                add_exclusions(self.run, outcome.lost, job_id=self.job_id, reason=outcome.cause)
                self.run.event("node_failed", job_id=self.job_id, nodes=outcome.lost, step=step,
                               resume_from=latest_checkpoint_step(self.run))
                continue  # a lost node is not the run's fault: no relaunch budget spent
            self.relaunches += 1
            if self.relaunches > self.fault.max_restarts:
                error = (f"{outcome.kind} {self.relaunches} times in job {self.job_id}"
                         f" (fault.max_restarts={self.fault.max_restarts}); last cause: {outcome.cause}")
                record_failure(self.run, error=error, restarts=self.run.starts() - 1, job_id=self.job_id, step=step)
                raise RuntimeError(error)
            self.run.event("relaunched", job_id=self.job_id, cause=outcome.kind, detail=outcome.cause, step=step,
                           resume_from=latest_checkpoint_step(self.run), attempt=self.relaunches)

    def _last_event_time(self, name: str) -> float:
        times = [e["time"] for e in self.run.events_list() if e.get("event") == name]
        return times[-1] if times else time.time()

    def _requeued_anyway(self, wait_s: float = 10.0) -> bool:
        """Whether the job is on its way back to the queue (it passes through COMPLETING)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            state = slurmctl.job_state(self.job_id)
            if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
                return True
            if state not in ("COMPLETING", "RUNNING"):
                return False
            time.sleep(0.5)
        return False

    def _recovery_from_previous_job(self) -> float:
        """A start after a requeue measures its recovery from the detection that caused it."""
        events = self.run.events_list()
        last_start = max((i for i, e in enumerate(events) if e.get("event") == "started"), default=-1)
        for e in reversed(events[last_start + 1:]):
            if e.get("event") == "requeued":
                return float(e.get("detected_at") or e["time"])
        return 0.0

    def _requeue(self, *, reason: str, exclude: list[str], detected_at: float, check_progress: bool = True,
                 step_at_start: int = 0) -> int:
        """Put the job back in the queue (with the exclusions), unless this start made no
        progress, which would loop forever."""
        step = latest_checkpoint_step(self.run)
        if check_progress and step <= step_at_start:
            error = (f"job {self.job_id} stopped again at step {step} without completing a checkpoint since its"
                     " start; not requeued (is the time limit shorter than start-up plus a save?)")
            record_failure(self.run, error=error, restarts=self.run.starts() - 1, job_id=self.job_id, step=step)
            raise RuntimeError(error)
        if exclude:
            subprocess.run(["scontrol", "update", f"JobId={self.job_id}", f"ExcNodeList={','.join(exclude)}"],
                           capture_output=True, text=True)
        self.run.event("requeued", job_id=self.job_id, step=step, reason=reason, exclude=exclude,
                       detected_at=detected_at)
        # The job becomes PENDING again; scontrol ends this batch script while doing it.
        proc = subprocess.run(["scontrol", "requeue", self.job_id], capture_output=True, text=True)
        if proc.returncode != 0 and self._requeued_anyway():
            return EXIT_STOPPED  # e.g. preemption with PreemptMode=REQUEUE: Slurm requeued it first
        if proc.returncode != 0:
            error = f"scontrol requeue {self.job_id} failed: {proc.stderr.strip()}"
            record_failure(self.run, error=error, restarts=self.run.starts() - 1, job_id=self.job_id)
            raise RuntimeError(error)
        return EXIT_STOPPED


def drive(run_dir: str) -> int:
    run = RunDir(Path(run_dir))
    plan = Plan.from_json(run.plan_json.read_text())
    return Supervisor(run, plan, os.environ.get("SLURM_JOB_ID", "?")).drive()
