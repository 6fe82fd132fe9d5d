"""The driver inside a Slurm allocation: one per job, on the batch host.

submitit runs `drive(run_dir)` once, in the batch script (`use_srun=False`). The driver
starts the worker step with srun, watches it (exit code, and the heartbeat rank 0 beats)
and owns every recovery decision; workers never requeue themselves. What it does after
each start is the table in dtk/driver/decide.py, applied by the loop of the driver core
both drivers share (dtk/driver/core.py); this module gathers the facts of a start on Slurm
and carries the decisions out.

Every Slurm command goes through a `dtk.launch.slurmctl.Slurm` and every wait through its
clock, so tests run the whole loop against a fake Slurm in fake time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from dtk.common.rundir import RunDir
from dtk.common.storage import StoreUnreachable
from dtk.driver.core import DriverCore
from dtk.driver.decide import Decision, Facts, Outcome, classify
from dtk.driver.exclusions import add_exclusions, read_exclusions
from dtk.driver.local import free_port, stop_request_text
from dtk.driver.logs import SRUN_LOG, config_error_line, failure_cause
from dtk.driver.record import record_failure, record_stopped
from dtk.driver.resize import GrowWatch, fit_plan
from dtk.driver.resubmit import preempted_cancels, resubmit, signal_lead_of
from dtk.driver.timeleft import TimeLeft, cut_short
from dtk.launch.slurmctl import Slurm, SlurmUnavailable
from dtk.plan.binding import gpu_step_flags
from dtk.plan.plan import Plan
from dtk.worker.codes import EXIT_STOPPED
from dtk.worker.env import ENV_TABLES, driver_env

POLL_S = 0.5
KILL_WAIT_S = 30.0
# Variables of the local driver that must not leak into srun tasks: the workers there read
# their rank from SLURM_PROCID (see dtk.worker.env).
_LOCAL_ONLY = tuple(ENV_TABLES["dtk"].values())  # rank variables of the local driver; srun sets Slurm's


class DriverFailed(RuntimeError):
    """The job cannot go on; the message is the run's recorded error."""


def srun_command(plan: Plan, *, logs: Path, nodes: list[str]) -> list[str]:
    """The worker step. --cpus-per-task is explicit: since Slurm 22.05 srun no longer
    inherits it from sbatch, and each task would get one core for its main thread, data
    thread, checkpoint writer and communication threads."""
    cluster = plan.config.cluster
    cmd = [
        "srun",
        f"--nodes={plan.nodes}",
        f"--ntasks={plan.world_size}",
        f"--ntasks-per-node={plan.tasks_per_node}",
        f"--cpus-per-task={cluster.cpus_per_task}",
        f"--nodelist={','.join(nodes)}",
    ]
    cmd += gpu_step_flags(plan)  # one GPU per task, or the site's cluster.gpu_bind
    return cmd + [
        "--kill-on-bad-exit=1",  # one dead rank ends the step instead of leaving the rest hung
        "--unbuffered",
        f"--output={logs}/rank_%t.log",
        sys.executable,
        "-m",
        "dtk.worker",
        str(plan.run_dir),
    ]


class Supervisor(DriverCore):
    """The Slurm backend of DriverCore (dtk/driver/core.py); its clock is its Slurm's."""

    def __init__(self, run: RunDir, plan: Plan, job_id: str, *, slurm: Slurm | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        slurm = slurm or Slurm()
        super().__init__(run, plan, job_id, clock=slurm.clock)
        self.slurm = slurm
        self.environ = dict(os.environ if environ is None else environ)
        self.signalled = 0  # SIGTERM (preemption, scancel) or USR2 seen by the driver itself
        self.restart_count = int(self.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        self.stop_signalled = False  # the workers were told to stop for a dtk.stop request
        self.stop_by = ""  # who asked, once the workers were told
        self.grow: GrowWatch | None = None  # while running on fewer nodes than the plan
        self.stop_reason = ""  # set once the driver stopped the workers itself (to grow back, before the limit)
        self.time_left: TimeLeft | None = TimeLeft(run=run, slurm=self.slurm, job_id=job_id, plan=plan)
        self.next_start: tuple[Plan, list[str]] | None = None  # the plan and nodes before_start chose

    def note_signal(self, signum: int, _frame=None) -> None:
        """Replaces submitit's handlers in this process: USR2 there would end the driver,
        and deciding what a signal means is the driver's job. The workers got their own."""
        self.signalled = signum

    # --- Slurm facts -------------------------------------------------------------------
    def allocation(self) -> list[str]:
        """Nodes the job holds now; with --no-kill a failed node drops out of this list."""
        nodes = self.slurm.job_nodes(self.job_id)
        return nodes if nodes is not None else self.slurm.expand_nodelist(self.environ["SLURM_JOB_NODELIST"])

    def _kill_step(self, proc) -> None:
        try:
            self.slurm.kill_steps(self.job_id)
        except SlurmUnavailable as exc:  # srun takes its step down with it
            print(f"driver: {exc}; killing srun", file=sys.stderr, flush=True)
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
        before = [e for e in self.run.events_list() if e.get("event") in ("started", "node_returned")]
        self.run.event(
            "started",
            restart=restart,
            job_id=self.job_id,
            slurm_restart_count=int(self.environ.get("SLURM_RESTART_COUNT", "0")),
            nodes=nodes,
            world_size=plan.world_size,
            batch_host=socket.gethostname(),
        )
        if before and before[-1]["event"] == "node_returned":  # this start is the grow-back
            self.run.event("grown", job_id=self.job_id, nodes=nodes, from_world_size=before[-1]["world_size"],
                           world_size=plan.world_size)
        seen_events = len(self.run.events_list())
        env = {k: v for k, v in self.environ.items() if k not in _LOCAL_ONLY}
        env.update(
            # The batch host is the allocation's first node; a port free here is free for
            # rank 0's rendezvous store on the lab and on clusters that place rank 0 here.
            **driver_env(master_addr=nodes[0], master_port=free_port(), restart=restart, plan=plan_file,
                         recovery_from=recovery_from),
            PYTHONUNBUFFERED="1",
        )
        cmd = srun_command(plan, logs=logs, nodes=nodes)
        print("driver:", " ".join(cmd), flush=True)
        signalled_before = self.signalled
        started = self.clock.time()
        proc = self.slurm.start_step(cmd, env=env, report=logs / SRUN_LOG)
        hung = self._watch(proc, started, nodes)
        if hung is not None:
            return hung
        detected = self.clock.time()
        code = proc.returncode
        new_events = self.run.events_list()[seen_events:]
        failed = code != 0
        signalled = self.signalled != signalled_before
        left = set(self.allocation()) if failed else set(nodes)
        facts = Facts(
            code=code,
            stop_asked=self._stop_asked(signalled) if failed else "",
            workers_stopped=any(e.get("event") == "preempted" for e in new_events),
            signalled=signalled,
            lost=tuple(n for n in nodes if n not in left),
            error_line=config_error_line(logs) if failed else None,
            crash_cause=failure_cause(logs, code) if failed else "",
        )
        return classify(facts, detected_at=detected)

    def _watch(self, proc, started: float, nodes: list[str]) -> Outcome | None:
        """Wait for the step to end; tear it down when its heartbeat stops. Returns the
        HUNG outcome, or None once the step exited by itself."""
        while proc.poll() is None:
            self.clock.sleep(POLL_S)
            if not self.stop_signalled and self.run.read_stop_request() is not None:
                self._tell_workers_to_stop()
            found = self.silence(started)
            if self.grow is not None and not self.stop_reason:
                self._grow_back(nodes)
            self._stop_before_the_limit()
            if found.hung and proc.poll() is None:
                outcome = self.hang_detected(found, nodes)
                self._kill_step(proc)
                return outcome
        return None

    # --- a stop someone asked for -------------------------------------------------------
    def _tell_workers_to_stop(self) -> None:
        """A dtk.stop request: SIGTERM to the worker step (they agree, save and exit 3), or
        SIGKILL with --now (no save: the run resumes from the last committed checkpoint)."""
        request = self.run.read_stop_request() or {}
        self.stop_signalled = True
        self.stop_by = stop_request_text(request)  # kept: dtk.stop removes its request when it gives up waiting
        self.slurm.signal_steps(self.job_id, "KILL" if request.get("now") else "TERM")

    def _stop_asked(self, signalled: bool) -> str:
        """Who asked this start to stop: a dtk.stop request, or `scancel JOB` (the driver
        got SIGTERM and Slurm shows the job cancelled, not preempted or timed out); else ''."""
        request = self.run.read_stop_request()
        if request is not None or self.stop_by:
            return stop_request_text(request) if request is not None else self.stop_by
        if (signalled and self.slurm.cancelled(self.job_id, restart_count=self.restart_count)
                and not preempted_cancels(self.slurm, self.job_id)):  # past the grace time it looks cancelled
            return f"scancel {self.job_id}"
        return ""

    def _stop(self, by: str) -> int:
        checkpoint = record_stopped(self.run, by=by, restarts=self.restarts(), job_id=self.job_id)
        where = f"checkpoint step {checkpoint}" if checkpoint is not None else "no checkpoint yet"
        print(f"driver: stopped ({by}); not requeued; {where}", flush=True)
        return 0

    # --- the loop ------------------------------------------------------------------------
    def before_start(self) -> int | None:
        """A stop asked before this start ends the job; too few usable nodes requeue it.
        `drive()` (the core's loop) then ends with 0 (finished or stopped), EXIT_STOPPED
        (requeued), or raises DriverFailed with the failure recorded in the run."""
        request = self.run.read_stop_request()
        if request is not None:  # asked before this start: do not start
            return self._stop(stop_request_text(request))
        self._check_step_bound()
        excluded = read_exclusions(self.run)
        usable = [n for n in self.allocation() if n not in excluded]
        plan = fit_plan(self.plan, len(usable), allow_shrink=self.fault.shrink)
        if plan is None:
            return self._requeue(reason=f"{len(usable)} usable node(s) left, {self.plan.nodes} needed",
                                 detected_at=self.recovery_from)
        self.next_start = (plan, usable[: plan.nodes])
        self.grow = (GrowWatch(run=self.run, slurm=self.slurm, plan=self.plan, environ=self.environ,
                               partition=self.plan.config.cluster.partition)
                     if plan.nodes < self.plan.nodes else None)
        return None

    def _check_step_bound(self) -> None:
        """fault.max_steps: the worker steps this job started (the run's `started` events of
        its id, across requeues) bound the next one; sites cap a job's steps (MaxStepCount)."""
        started = sum(1 for e in self.run.events_list() if e.get("event") == "started" and e.get("job_id") == self.job_id)
        bound = self.fault.max_steps
        if started >= bound:
            self._fail(f"job {self.job_id} started {started} worker steps (fault.max_steps={bound}); not starting"
                       f" another: run the same command again to go on from checkpoint step {self.checkpoint_step()}"
                       " as a new job, or raise fault.max_steps (below the site's MaxStepCount)",
                       step=self.last_step())

    def start_workers(self, recovery_from: float) -> Outcome:
        assert self.next_start is not None, "before_start chooses the plan and nodes of each start"
        plan, nodes = self.next_start
        return self.start(plan, nodes, recovery_from)

    # --- the actions of dtk/driver/decide.py --------------------------------------------
    def on_stop(self, decision: Decision, outcome: Outcome, step: int) -> int:
        return self._stop(outcome.cause)

    def on_fail(self, decision: Decision, outcome: Outcome, step: int) -> NoReturn:
        self._fail(decision.error, step=self.last_step())

    def on_requeue(self, decision: Decision, outcome: Outcome, step: int) -> int:
        return self._requeue(reason=self.stop_reason or "stopped on a signal",
                             detected_at=self._last_event_time("preempted"))

    def on_exclude(self, decision: Decision, outcome: Outcome, step: int) -> int | None:
        add_exclusions(self.run, list(outcome.lost), job_id=self.job_id, reason=outcome.cause)
        self.run.event("node_failed", job_id=self.job_id, nodes=list(outcome.lost), step=self.last_step(),
                       **self.resume_fields(step))
        return None

    def _stop_before_the_limit(self) -> None:
        """Stop the workers (they save) once the time left falls to what a stop needs;
        at most once per allocation."""
        if self.time_left is None or self.stop_reason or not self.time_left.poll():
            return
        t = self.time_left
        self.time_left = None
        preempted = cut_short(self.slurm, self.job_id)  # ended before its limit: a preemption's grace time
        ends = "preempted: Slurm ends the job" if preempted else "time limit"
        self.stop_reason = f"{ends} in {t.left_s:.0f} s, a stop needs {t.need_s:.0f} s"
        self.run.event("time_limit_near", job_id=self.job_id, step=self.last_step(), left_s=round(t.left_s, 1),
                       need_s=round(t.need_s, 1), preempted=preempted)
        self.slurm.signal_steps(self.job_id, "USR2")

    def _grow_back(self, nodes: list[str]) -> None:
        """Running shrunk: once this start logged a trained step (so that its stop saves a
        new checkpoint) and enough nodes are back, stop the workers at the next step
        boundary (they save), so that the job requeues at its full size."""
        restart = self.run.starts() - 1
        assert self.grow is not None, "only while running shrunk"
        if not self.grow.due() or not any(r.get("restart") == restart for r in self.run.latest_metrics().values()):
            return
        back = self.grow.poll(nodes)
        if back:
            self.stop_reason = f"grow back to {self.plan.nodes} nodes"
            self.run.event("node_returned", job_id=self.job_id, nodes=back, step=self.last_step(),
                           world_size=len(nodes) * self.plan.tasks_per_node, to_world_size=self.plan.world_size)
            self.slurm.signal_steps(self.job_id, "USR2")

    def _fail(self, error: str, **details) -> NoReturn:
        record_failure(self.run, error=error, restarts=self.restarts(), job_id=self.job_id, **details)
        raise DriverFailed(error)

    def _last_event_time(self, name: str) -> float:
        times = [e["time"] for e in self.run.events_list() if e.get("event") == name]
        return times[-1] if times else self.clock.time()

    def recovery_from_previous_job(self) -> float:
        """A start after a requeue measures its recovery from the detection that caused it."""
        events = self.run.events_list()
        last_start = max((i for i, e in enumerate(events) if e.get("event") == "started"), default=-1)
        for e in reversed(events[last_start + 1:]):
            if e.get("event") in ("requeued", "resubmitted"):
                return float(e.get("detected_at") or e["time"])
        return 0.0

    def _requeue(self, *, reason: str, detected_at: float) -> int:
        """Put the job back in the queue, its ExcNodeList set to the run's exclusions as
        they are now plus cluster.exclude_from (and only those: a node given back meanwhile
        may be allocated again)."""
        from dtk.common import audit
        from dtk.common.errors import UserError
        from dtk.launch.launch import read_exclude_file

        try:
            listed = read_exclude_file(self.plan.config.cluster.exclude_from)
        except UserError:  # checked at submission; unreadable from here: the run's own list
            listed = ()
        exclude = sorted(set(read_exclusions(self.run)) | set(listed))
        if preempted_cancels(self.slurm, self.job_id):
            # PreemptMode=CANCEL: the job is gone after the grace time (dtk/driver/resubmit.py).
            try:
                job = resubmit(self.run, self.plan, self.job_id, exclude=exclude, entry=drive)
            except Exception as exc:  # noqa: BLE001 - sbatch refused, or submitit failed: try the requeue
                print(f"driver: resubmitting after a preemption that cancels failed ({exc}); requeueing instead",
                      file=sys.stderr, flush=True)
            else:
                self.run.event("resubmitted", cluster="slurm", job_id=job, after_job=self.job_id, step=self.checkpoint_step(),
                               reason=f"preempted on a partition whose PreemptMode cancels job {self.job_id}",
                               exclude=exclude, detected_at=detected_at,
                               signal_lead_s=signal_lead_of(self.run, self.plan.config.fault.signal_lead_floor_s))
                print(f"driver: job {self.job_id} is preempted and will be cancelled (PreemptMode=CANCEL); the run"
                      f" goes on in job {job} from checkpoint step {self.checkpoint_step()}", flush=True)
                return EXIT_STOPPED
        self.run.event("requeued", job_id=self.job_id, step=self.checkpoint_step(), reason=reason,
                       exclude=exclude, detected_at=detected_at)
        # The job becomes PENDING again; Slurm sends this batch script SIGTERM (ignored here).
        refused, not_excluded = self.slurm.requeue_excluding(self.job_id, exclude)
        if refused:
            self._fail(f"scontrol requeue {self.job_id} failed: {refused}")
        audit.record_or_warn(self.run.path, "requeue", job_ids=[self.job_id], by="driver", reason=reason, exclude=exclude)
        if not_excluded:
            print(f"driver: Slurm refused to exclude {','.join(exclude) or 'no node'}: {not_excluded}",
                  file=sys.stderr, flush=True)
        return EXIT_STOPPED


def drive(run_dir: str, *, slurm: Slurm | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The batch script's entry point (through submitit). A failure ends the job with one
    `error:` line in its log, after the run's summary recorded it."""
    run = RunDir(Path(run_dir))
    plan = Plan.from_json(run.plan_json.read_text())
    environ = os.environ if environ is None else environ
    supervisor = Supervisor(run, plan, environ.get("SLURM_JOB_ID", "?"), slurm=slurm, environ=environ)
    previous = {sig: signal.signal(sig, supervisor.note_signal) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        return supervisor.drive()
    except SlurmUnavailable as exc:
        error = f"Slurm did not answer the driver of job {supervisor.job_id}: {exc}"
        record_failure(run, error=error, restarts=max(0, run.starts() - 1), job_id=supervisor.job_id)
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise
    except DriverFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise
    except StoreUnreachable as exc:  # the checkpoint store (checkpoint.dir=s3://...) did not answer
        error = (f"the driver of job {supervisor.job_id} could not list the run's checkpoints ({exc}); the job ends"
                 " without a requeue: submit the same command again once the store answers")
        record_failure(run, error=error, restarts=max(0, run.starts() - 1), job_id=supervisor.job_id)
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
