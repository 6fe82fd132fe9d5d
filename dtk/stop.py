"""python -m dtk.stop RUN_DIR [--now]: stop a run, local or on Slurm, without a requeue.

The run's driver does the stopping, so that it happens the one way whoever asks: this
command writes RUN_DIR/stop_request.json, the driver sees it within a second, tells the
workers to stop (SIGTERM: they agree at the next step boundary, save, commit and exit;
with --now SIGKILL, no save), records a `stopped` event and a stopped summary with the
checkpoint to resume from, and ends without requeueing. A Slurm job still waiting in the
queue has no driver yet: it is cancelled here. `scancel JOB` of a running job does the same
as this command without --now (the driver tells a cancel from a preemption or a time limit).

Submitting the same command again resumes from that checkpoint.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from dtk.access.check import check_action
from dtk.common import audit
from dtk.common.errors import ArgumentParser, UserError, run_cli
from dtk.common.processes import driver_alive
from dtk.common.rundir import RunDir, write_json_atomic

POLL_S = 0.5
QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING", "SUSPENDED")


def where(run: RunDir) -> tuple[str, str | None, str]:
    """('local', None, 'running'|'not running') or ('slurm', job, Slurm's state or 'gone')."""
    events = run.events_list()
    # A preemption that cancels the job resubmits the run as a new job (dtk/driver/resubmit.py).
    submitted = [e for e in events if e.get("event") in ("submitted", "resubmitted")]
    if submitted and submitted[-1].get("cluster") == "slurm":
        from dtk.launch import slurmctl

        job = str(submitted[-1]["job_id"])
        return "slurm", job, slurmctl.job_state(job) or "gone"
    starts = [e for e in events if e.get("event") == "started"]
    return "local", None, "running" if starts and driver_alive(starts[-1]) else "not running"


def wait_stopped(run: RunDir, *, since: float, timeout_s: float) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in reversed(run.events_list()):
            if e.get("time", 0) < since:
                break
            if e.get("event") in ("stopped", "finished", "failed"):
                return e
        time.sleep(POLL_S)
    return None


def stop(run: RunDir, *, now: bool, timeout_s: float) -> str:
    """Stop the run; what was done, in one or two lines."""
    kind, job, state = where(run)
    summary = run.read_summary() or {}
    if summary.get("status") in ("finished", "failed", "stopped") and state in ("gone", "not running"):
        raise UserError(f"{run.path}: the run is not running (it {summary['status']} at step "
                        f"{summary.get('final_step')}); nothing to stop")
    user = audit.current_user()
    by = user.get("sudo_user") or user["name"]
    if kind == "slurm" and state in QUEUED:
        from dtk.driver.record import record_stopped

        proc = subprocess.run(["scancel", str(job)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise UserError(f"scancel {job}: {proc.stderr.strip()}")
        checkpoint = record_stopped(run, by=f"dtk.stop by {by}", restarts=max(0, run.starts() - 1), job_id=job)
        return f"job {job} was {state}: cancelled, nothing ran; " + _resume(run, checkpoint)
    if state not in ("running", "RUNNING", "COMPLETING"):
        raise UserError(f"{run.path}: the run is not running ({'job ' + job + ' ' if job else ''}{state});"
                        " nothing to stop")
    asked = time.time()
    write_json_atomic(run.stop_request, {"by": by, "now": now, "time": asked})
    how = "the workers are killed without saving (--now)" if now else "the workers save at the end of this step"
    what = f"job {job}" if job else "the local driver"
    ended = wait_stopped(run, since=asked - 1, timeout_s=timeout_s)
    if ended is None or ended["event"] != "stopped":
        _withdraw(run, asked)  # a request left behind would stop the next start of this run
    if ended is None:
        hint = f"; `scancel {job}` ends the job" if job else ""
        return (f"asked {what} to stop ({how}); it has not stopped within {timeout_s:g} s, and the request is"
                f" withdrawn. Watch python -m dtk.status {run.path}{hint}")
    if ended["event"] != "stopped":
        return f"the run {ended['event']} before the stop took effect (step {ended.get('step')})"
    return f"stopped {what} at step {ended.get('step')} ({how}); not requeued; " + _resume(run, ended.get("checkpoint"))


def _withdraw(run: RunDir, asked: float) -> None:
    """Remove this command's request, not one a later dtk.stop wrote meanwhile. A driver
    that already told its workers keeps what was asked."""
    request = run.read_stop_request()
    if request is not None and request.get("time") == asked:
        run.stop_request.unlink(missing_ok=True)


def _resume(run: RunDir, checkpoint: int | None) -> str:
    where_from = f"checkpoint step {checkpoint}" if checkpoint is not None else "the start (no checkpoint)"
    return f"submitting the same command again resumes from {where_from} (python -m dtk.status {run.path})"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m dtk.stop", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory (under run.root)")
    parser.add_argument("--now", action="store_true", help="kill the workers without a save: the run resumes from"
                        " the last committed checkpoint")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="seconds to wait for the driver to report the stop (default 300)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    run = RunDir(args.run_dir)
    run.read_plan()  # a folder that is not a run directory stops here
    check_action(run.path, "submitter", doing="stop a run")
    audit.check_writable(audit.run_root_of(run.path))
    said = stop(run, now=args.now, timeout_s=args.timeout)
    jobs = [str(e["job_id"]) for e in run.events_list() if e.get("event") in ("submitted", "resubmitted")
            and e.get("job_id")]
    audit.record_run(run.path, "stop", job_ids=jobs[-1:], now=args.now, said=said)
    print(said)
    return 0


if __name__ == "__main__":
    from dtk.access.check import explain_denied

    run_cli(main, on_denied=explain_denied)

