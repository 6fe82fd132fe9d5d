"""python -m dtk.drill {preempt,timelimit,node-fail,crash,hang,storage,nan} RUN_DIR: inject a
real fault into a live run (Slurm, or any run for storage and nan), to see (and test) that
it recovers.

    preempt     a high-priority job on the `high` partition takes the run's nodes; with
                --full, SIGTERM first reaches every process of the job (scancel --signal=TERM
                --full: the batch script, the driver, each worker), as where a site's Slurm
                signals them all: the save it starts completes, or is never resumed from
    timelimit   the job's time limit is cut so that it ends shortly after the signal lead;
                once the workers stopped, the limit is given back (the command waits)
    node-fail   a node of the run (not the batch host) is set DOWN
    crash       one worker is killed with SIGKILL
    hang        one worker is stopped with SIGSTOP (a collective that never completes)
    storage     RUN_DIR/checkpoints turns read-only for --hold seconds, then writable again
                (root; the saves in between fail, training goes on: dtk.drill.storage)
    nan         the loss of --steps steps from --at-step on (default: the next step) is NaN:
                RUN_DIR/nan_request.json, read by rank 0 at a step boundary; the run skips
                those updates and, with fault.rollback_after of them, rolls back (Divergence
                in docs/recovery.md). Local or Slurm; a run not yet training takes it too

Afterwards `python -m dtk.status RUN_DIR` and events.jsonl show what happened.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from dtk.access.check import check_action
from dtk.common import audit
from dtk.common.errors import ArgumentParser, UserError, run_cli
from dtk.common.rundir import RunDir
from dtk.launch import slurmctl

DRILLS = ("preempt", "timelimit", "node-fail", "crash", "hang", "storage", "nan")


def _last_start(run: RunDir) -> dict:
    starts = [e for e in run.events_list() if e.get("event") == "started"]
    if not starts:
        raise UserError(f"{run.path}: the run has not started yet; nothing to drill")
    start = starts[-1]
    if not str(start.get("job_id", "")).isdigit():
        raise UserError(f"{run.path}: the latest start is not a Slurm job (job {start.get('job_id')}); drills need Slurm")
    state = slurmctl.job_state(str(start["job_id"]))
    if state != "RUNNING":
        raise UserError(f"job {start['job_id']} is {state or 'gone'}, not RUNNING; drill a live run")
    return start


def _scontrol(*args: str) -> None:
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"scontrol {' '.join(args)}: {proc.stderr.strip()}")


def is_worker_of(pid: int, run: RunDir) -> bool:
    """Whether `pid` on this host is `python -m dtk.worker RUN_DIR` of this run (a pid file
    outlives its process, and the pid may have been reused since)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    args = [a.decode(errors="replace") for a in argv if a]
    for i in range(len(args) - 2):
        if args[i : i + 2] == ["-m", "dtk.worker"]:
            return Path(args[i + 2]).resolve() == run.path.resolve()
    return False


def _signal_worker(run: RunDir, start: dict, rank: int | None, sig: signal.Signals) -> str:
    logs = run.log_dir(start["restart"])
    ranks = sorted(int(p.stem.split("_")[1]) for p in logs.glob("rank_*.pid"))
    if not ranks:
        raise UserError(f"{logs}: no worker pid files yet; wait until the workers have started")
    rank = ranks[-1] if rank is None else rank
    if rank not in ranks:
        raise UserError(f"--rank {rank}: no such worker (ranks: {ranks[0]}..{ranks[-1]})")
    host, pid = (logs / f"rank_{rank}.pid").read_text().split()
    if host == socket.gethostname():
        if not is_worker_of(int(pid), run):
            raise UserError(f"pid {pid} (rank {rank}, from {logs / f'rank_{rank}.pid'}) is not a dtk worker of"
                            f" {run.path} (the worker ended, and the pid may be another process now); not signalling")
        os.kill(int(pid), sig)
    else:  # on a real cluster: inside the job's allocation, next to the worker, after the same check
        check = f"tr '\\0' ' ' < /proc/{pid}/cmdline | grep -q -- '-m dtk.worker {run.path.resolve()}'"
        proc = subprocess.run(["srun", f"--jobid={start['job_id']}", "--overlap", "-N1", "-n1", f"-w{host}", "sh",
                               "-c", f"{check} && kill -{sig.name.removeprefix('SIG')} {pid}"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise UserError(f"pid {pid} on {host} is not a dtk worker of {run.path}, or could not be signalled;"
                            " not signalled")
    return f"sent {sig.name} to rank {rank} (pid {pid} on {host})"


def _job_field(job: str, key: str) -> str:
    info = slurmctl.parse_kv_line(subprocess.run(["scontrol", "show", "job", job, "-o"],
                                                 capture_output=True, text=True).stdout)
    return info.get(key, "")


def _timelimit(run: RunDir, job: str, *, poll_s: float = 1.0) -> str:
    """Cut the job's time limit to end shortly after the signal lead, wait until the fault
    was delivered (the workers stopped on the signal, or the job left RUNNING), then give
    the job its limit back, so that the requeued job is not cut again. Slurm keeps time
    limits in whole minutes: what it set is read back and printed, not what was asked."""
    original = _job_field(job, "TimeLimit")
    elapsed_s = (slurmctl.parse_time_min(_job_field(job, "RunTime") or "0:0:0") or 0) * 60
    lead_s = int(next((e.get("signal_lead_s", 60) for e in reversed(run.events_list())
                       if e.get("event") == "submitted"), 60))
    minutes = math.ceil((elapsed_s + lead_s + 15) / 60)
    seen = len(run.events_list())
    _scontrol("update", f"JobId={job}", f"TimeLimit={minutes}")
    cut = _job_field(job, "TimeLimit")
    print(f"job {job} time limit cut from {original} to {cut} (run time {elapsed_s / 60:.1f} min,"
          f" signal lead {lead_s} s); waiting for the stop", flush=True)
    deadline = time.monotonic() + (minutes * 60 - elapsed_s) + 180
    while time.monotonic() < deadline:
        new = run.events_list()[seen:]
        if any(e.get("event") in ("preempted", "requeued", "failed") for e in new):
            break
        if slurmctl.job_state(job) != "RUNNING":
            break
        time.sleep(poll_s)
    else:
        print(f"job {job} did not stop within {deadline:.0f} s of the cut", flush=True)
    if slurmctl.job_state(job) is None:
        return f"job {job} is gone; nothing to restore (its limit was {original})"
    try:
        _scontrol("update", f"JobId={job}", f"TimeLimit={original}")
    except UserError as exc:
        raise UserError(f"{exc}; job {job} keeps the cut limit {cut}: restore it as an operator with"
                        f" `scontrol update JobId={job} TimeLimit={original}`") from None
    return f"job {job} time limit restored: Slurm shows {_job_field(job, 'TimeLimit')} (was {original})"


def _signal_every_process(job: str) -> str:
    """SIGTERM to every process of the job, the batch script's too (scancel --full), not
    only to each step's tasks: what Slurm does where a site signals the whole job."""
    proc = subprocess.run(["scancel", "--signal=TERM", "--full", job], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"scancel --signal=TERM --full {job}: {proc.stderr.strip()}")
    return f"SIGTERM to every process of job {job} (the batch script, the driver, each worker); "


def drill(kind: str, run: RunDir, *, rank: int | None = None, hold_s: int = 30, full: bool = False) -> str:
    start = _last_start(run)
    job = str(start["job_id"])
    nodes = start["nodes"]
    if kind == "preempt":
        signalled = _signal_every_process(job) if full else ""
        proc = subprocess.run(
            ["sbatch", "--parsable", "--partition=high", "--exclusive", f"--nodes={len(nodes)}",
             f"--nodelist={','.join(nodes)}", "--job-name=dtk-drill-preempt", "--output=/dev/null",
             f"--wrap=sleep {hold_s}"],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise UserError(f"could not submit the preempting job: {proc.stderr.strip()}")
        return (f"{signalled}high-priority job {proc.stdout.strip()} takes {','.join(nodes)} for {hold_s} s;"
                f" job {job} is preempted")
    if kind == "timelimit":
        return _timelimit(run, job)
    if kind == "node-fail":
        if len(nodes) < 2:
            raise UserError(f"job {job} runs on one node ({nodes[0]}), its batch host; node-fail needs a second node")
        victim = nodes[-1]  # not the first: that is the batch host, whose loss ends the job itself
        _scontrol("update", f"NodeName={victim}", "State=DOWN", "Reason=dtk-drill")
        return (f"node {victim} set DOWN; the lab may return it by itself (ReturnToService=2). To give it back by hand"
                f" if it is still down: if sinfo -h -N -n {victim} -t down,drain -o %N | grep -q .; then scontrol update"
                f" nodename={victim} state=resume; fi (docs/recovery.md, A node failed)")
    if kind == "crash":
        return _signal_worker(run, start, rank, signal.SIGKILL)
    if kind == "hang":
        return _signal_worker(run, start, rank, signal.SIGSTOP)
    raise UserError(f"no such drill {kind!r}; choose one of {', '.join(DRILLS)}")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m dtk.drill", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=DRILLS)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--rank", type=int, default=None, help="worker for crash/hang (default: the last rank)")
    parser.add_argument("--hold", type=int, default=30,
                        help="seconds the preempting job holds the nodes, or the storage stays read-only")
    parser.add_argument("--at-step", type=int, default=None,
                        help="nan: the first step (completed steps after it) whose loss is NaN (default: the next)")
    parser.add_argument("--steps", type=int, default=3, help="nan: how many steps in a row get a NaN loss")
    parser.add_argument("--full", action="store_true",
                        help="preempt: SIGTERM to every process of the job first, the batch script's too"
                             " (scancel --signal=TERM --full)")
    args = parser.parse_args(argv)
    if args.full and args.kind != "preempt":
        raise UserError(f"--full: only the preempt drill signals every process of the job, not {args.kind}")
    run = RunDir(args.run_dir)
    run.read_plan()  # a folder that is not a run directory stops here
    check_action(run.path, "submitter", doing=f"drill a run ({args.kind})")
    audit.check_writable(audit.run_root_of(run.path))
    if args.kind == "storage":
        from dtk.common.storage import LocalStorage, checkpoints_of
        from dtk.drill.storage import storage_drill

        store = checkpoints_of(run)
        if not isinstance(store, LocalStorage):
            raise UserError(f"storage: the drill makes a local checkpoint folder read-only; this run's checkpoints are in"
                            f" an object store ({store}), whose permissions are the store's: revoke its write access"
                            " there to drill it")
        said = storage_drill(store.path, hold_s=args.hold)
    elif args.kind == "nan":
        if args.steps < 1 or (args.at_step is not None and args.at_step < 1):
            raise UserError("--steps and --at-step must be at least 1")
        from dtk.train.divergence import write_nan_request

        path = write_nan_request(run.path, at_step=args.at_step, num_steps=args.steps)
        first = f"step {args.at_step}" if args.at_step else "the next step"
        said = f"{path}: the loss of {args.steps} step(s) from {first} on is NaN (rank 0 reads it at a step boundary)"
    else:
        said = drill(args.kind, run, rank=args.rank, hold_s=args.hold, full=args.full)
    job = next((str(e["job_id"]) for e in reversed(run.events_list()) if e.get("event") == "started"), None)
    audit.record_run(run.path, "drill", job_ids=[job] if job else [], kind=args.kind, said=said)
    print(said)
    return 0


if __name__ == "__main__":
    from dtk.access.check import explain_denied

    run_cli(main, on_denied=explain_denied)
