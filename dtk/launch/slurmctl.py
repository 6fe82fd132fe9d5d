"""Asking and telling Slurm: every squeue, scontrol, scancel and srun of dtk goes through here.

One seam: a `Slurm` runs its commands through a `Runner` and waits with a `Clock`. The
real ones call the programs and sleep; tests hand in a fake Slurm and a clock they move
forward (tests/fake_slurm.py), so every decision built on these answers is tested without
a cluster. Parsers are pure.

A query that fails for a reason that may pass (slurmctld busy or restarting: "Socket timed
out", "Unable to contact slurm controller", a command that hangs) is retried with growing
pauses for at most `retry_s`; then `SlurmUnavailable` says what failed for how long. An
answer that is final ("Invalid job id specified") is not retried, nor one that says this
host has no Slurm configuration at all.

Job state comes from squeue and scontrol, not sacct: many clusters (and the lab) run no
accounting database.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dtk.common.errors import Unanswered, UserError

COMMAND_TIMEOUT_S = 30.0
"""One Slurm command that has not answered after this long counts as a failed attempt."""
RETRY_S = 300.0
"""How long a query is retried before Slurm counts as unavailable (driver, submit.wait)."""
LOGIN_RETRY_S = 30.0
"""The same on the login node before a submission or for status: a person is waiting."""
PAUSES_S = (1.0, 2.0, 4.0, 8.0, 15.0)
"""Pauses between attempts; the last one repeats."""
GONE = "Invalid job id specified"
"""What squeue and scontrol say of a job Slurm no longer remembers: a final answer."""
TRANSIENT = ("timed out", "unable to contact", "no answer within", "temporarily unavailable",
             "connection refused", "zero bytes were transmitted")
"""Words of a failure that may pass (slurmctld busy or restarting), in lower case."""
UNCONFIGURED = ("could not establish a configuration source", "unable to process configuration file")
"""Words of a failure no retry mends (this host has no Slurm configuration), in lower case:
the query stops at the first such answer instead of waiting out its retry bound."""
WAITING = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")
"""States of a job that is back in the queue."""


class SlurmUnavailable(Unanswered):
    """Slurm did not answer a query within the retry bound."""


class Clock:
    """Wall time, monotonic time and sleep: the real ones. Tests pass a clock they move."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Runner:
    """Runs Slurm's programs: `run` for a command that answers, `start` for a job step
    (srun) that the caller watches like a Popen (poll, wait, kill, returncode)."""

    def run(self, argv: list[str], *, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
        _require(argv[0])
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    def start(self, argv: list[str], *, env: Mapping[str, str], report: Path | None = None) -> subprocess.Popen:
        """Start a step; srun's own messages (which task died first) go to `report` too."""
        _require(argv[0])
        if report is None:
            return subprocess.Popen(argv, env=dict(env))
        proc = subprocess.Popen(argv, env=dict(env), stderr=subprocess.PIPE, text=True, errors="replace")
        threading.Thread(target=_tee, args=(proc.stderr, report), daemon=True).start()
        return proc


def _tee(stream, path: Path) -> None:
    """Copy a step's stderr to the driver's stderr (its Slurm log) and to `path`, line by line."""
    with open(path, "a") as fh:
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            fh.write(line)
            fh.flush()


def _require(program: str) -> None:
    if shutil.which(program) is None:
        raise UserError(f"cluster.kind=slurm: `{program}` is not on PATH; run on a Slurm login node (or use cluster=local)")


def _said(proc: subprocess.CompletedProcess) -> str:
    return " ".join((proc.stderr or proc.stdout or f"exit code {proc.returncode}").split())


class Slurm:
    """The Slurm commands dtk uses, with retries for the queries."""

    def __init__(self, runner: Runner | None = None, clock: Clock | None = None, *, retry_s: float = RETRY_S) -> None:
        self.runner = runner or Runner()
        self.clock = clock or Clock()
        self.retry_s = retry_s

    def query(self, argv: list[str], *, final: Callable[[subprocess.CompletedProcess], bool] | None = None,
              ) -> subprocess.CompletedProcess:
        """Run a command until it answers (exit 0, or an answer `final` accepts) or
        `retry_s` has passed; then raise SlurmUnavailable with the last failure."""
        deadline = self.clock.monotonic() + self.retry_s
        attempt = 0
        while True:
            try:
                proc = self.runner.run(argv)
                if proc.returncode == 0 or (final is not None and final(proc)):
                    return proc
                why = _said(proc)
                if any(w in why.lower() for w in UNCONFIGURED):
                    raise SlurmUnavailable(f"`{' '.join(argv)}` failed: {why}")
            except subprocess.TimeoutExpired:
                why = f"no answer within {COMMAND_TIMEOUT_S:g} s"
            pause = PAUSES_S[min(attempt, len(PAUSES_S) - 1)]
            attempt += 1
            if self.clock.monotonic() + pause > deadline:
                raise SlurmUnavailable(
                    f"`{' '.join(argv)}` failed {attempt} time(s) over {self.retry_s:g} s; last: {why}")
            self.clock.sleep(pause)

    # --- the login node ------------------------------------------------------------------
    def partitions(self) -> list[Partition]:
        try:
            # --all: also the partitions this user is not admitted to (Slurm hides those), so
            # that a refusal can say "not admitted" instead of "no such partition".
            proc = self.query(["scontrol", "--all", "show", "partition", "-o"])
        except SlurmUnavailable as exc:
            raise UserError(f"cannot ask Slurm for its partitions: {exc}") from None
        return parse_partitions(proc.stdout)

    # --- one job ------------------------------------------------------------------------
    def job_info(self, job_id: str) -> dict[str, str] | None:
        """`scontrol show job` as a dict; None once Slurm has forgotten the job."""
        proc = self.query(["scontrol", "show", "job", job_id, "-o"], final=lambda p: GONE in p.stderr)
        return parse_kv_line(proc.stdout) if proc.returncode == 0 else None

    def job_state(self, job_id: str) -> str | None:
        """PENDING, RUNNING, COMPLETING, ... while Slurm remembers the job; None once it forgot."""
        proc = self.query(["squeue", "-h", "-j", job_id, "-o", "%T"], final=lambda p: GONE in p.stderr)
        state = proc.stdout.strip().splitlines() if proc.returncode == 0 else []
        if state:
            return state[0].strip()
        info = self.job_info(job_id)  # squeue drops a job soon after it ends; scontrol remembers longer
        return info.get("JobState") if info else None

    def job_nodes(self, job_id: str) -> list[str] | None:
        """The nodes the job holds now (with --no-kill a failed node drops out); None when
        Slurm does not say."""
        info = self.job_info(job_id)
        nodelist = info.get("NodeList") if info else None
        if not nodelist or nodelist == "(null)":
            return None
        return self.expand_nodelist(nodelist)

    def job_end_time(self, job_id: str) -> float | None:
        """When the job's time limit ends it (Slurm's EndTime, in this machine's clock);
        None without a limit or once Slurm forgot the job."""
        info = self.job_info(job_id) or {}
        try:
            return time.mktime(time.strptime(info.get("EndTime", ""), "%Y-%m-%dT%H:%M:%S"))
        except ValueError:  # Unknown, or no such field
            return None

    def expand_nodelist(self, nodelist: str) -> list[str]:
        """`node[1-3],gpu07` -> its host names (Slurm's own expansion: no slurmctld involved)."""
        proc = self.runner.run(["scontrol", "show", "hostnames", nodelist])
        if proc.returncode != 0:
            raise RuntimeError(f"scontrol show hostnames {nodelist}: {_said(proc)}")
        return proc.stdout.split()

    def step_ids(self, job_id: str) -> list[str]:
        """The job's numbered steps (`123.0`), not its batch or extern step."""
        proc = self.query(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], final=lambda p: GONE in p.stderr)
        return [s for s in proc.stdout.split() if s.split(".")[-1].isdigit()] if proc.returncode == 0 else []

    def cancelled(self, job_id: str, *, restart_count: int) -> bool:
        """Was the job cancelled (`scancel JOB`) rather than preempted or timed out? Asked
        by its driver after a SIGTERM. Slurm 22.05 (measured on the lab) shows all three
        as COMPLETING while the job's processes end; a time limit has Reason=TimeLimit, and
        a preemption that requeues has already counted the restart (Restarts grew past the
        allocation's SLURM_RESTART_COUNT). A preemption still in its GraceTime is RUNNING."""
        info = self.job_info(job_id)
        if info is None:
            return False
        ending = info.get("JobState") in ("COMPLETING", "CANCELLED")
        restarts = int(info.get("Restarts", restart_count) or restart_count)
        return ending and info.get("Reason") != "TimeLimit" and restarts == restart_count

    # --- telling Slurm ------------------------------------------------------------------
    def kill_steps(self, job_id: str) -> None:
        self.signal_steps(job_id, "KILL")


    def excluded(self, job_id: str) -> list[str]:
        """The job's ExcNodeList (expanded)."""
        info = self.job_info(job_id) or {}
        value = info.get("ExcNodeList", "(null)")
        return [] if value in ("(null)", "") else self.expand_nodelist(value)

    def set_excluded(self, job_id: str, nodes: list[str]) -> str | None:
        """Set the ExcNodeList of a pending job (an empty list clears it) and check that
        it took; None when done, else why not. Slurm refuses it while the job runs."""
        proc = self.query(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"],
                          final=lambda p: p.returncode > 0 and not _transient(_said(p)))
        if proc.returncode != 0:
            return _said(proc)
        now = self.excluded(job_id)
        return None if sorted(now) == sorted(nodes) else f"ExcNodeList is {','.join(now) or '(null)'} after the update"

    def requeue_excluding(self, job_id: str, nodes: list[str]) -> tuple[str | None, str | None]:
        """Requeue a running job so that its next allocation avoids `nodes` (and only
        those). Slurm takes ExcNodeList only from a pending job, so when it must change:
        requeue the job held (it cannot start yet), set ExcNodeList, check it, release the
        job; the release happens whatever came before it (a job left held never runs
        again). Returns (why the requeue failed, why the exclusion did not take), None
        for what worked."""
        if sorted(self.excluded(job_id)) == sorted(nodes):
            return self.requeue(job_id), None
        refused = self.requeue(job_id, hold=True)
        if refused:
            return refused, None
        try:
            return None, self.set_excluded(job_id, nodes)
        finally:
            self.query(["scontrol", "release", job_id], final=lambda p: p.returncode > 0 and not _transient(_said(p)))

    def node_states(self, partition: str | None = None) -> dict[str, str]:
        """Node -> Slurm's state as sinfo prints it (`idle`, `allocated`, `down*`, `drained`)."""
        argv = ["sinfo", "-h", "-N", "-o", "%N %T"] + ([f"--partition={partition}"] if partition else [])
        return dict(line.split(None, 1) for line in self.query(argv).stdout.splitlines() if line.strip())

    def signal_steps(self, job_id: str, signum_name: str) -> None:
        """Send the job's worker steps (not its batch step, the driver) a signal: `USR2` for
        the driver's own stop, `TERM` for a dtk.stop request, `KILL` to tear them down."""
        for step in self.step_ids(job_id):
            self.runner.run(["scancel", f"--signal={signum_name}", step])

    def requeue(self, job_id: str, *, hold: bool = False) -> str | None:
        """Put the job back in the queue (held: until `scontrol release`); None when that
        happened, else why not. Requeueing sends the batch script SIGTERM (the driver
        ignores it); a command of the driver running at that moment may die of it."""
        deadline = self.clock.monotonic() + self.retry_s
        while True:
            try:
                proc = self.runner.run(["scontrol", "requeuehold" if hold else "requeue", job_id])
                if proc.returncode == 0:
                    return None
                refused = _said(proc)
            except subprocess.TimeoutExpired:
                refused = f"no answer within {COMMAND_TIMEOUT_S:g} s"
            if not _transient(refused) or self.clock.monotonic() + PAUSES_S[0] > deadline:
                break
            self.clock.sleep(PAUSES_S[0])
        # A refusal may mean that Slurm requeued the job first (preemption with
        # PreemptMode=REQUEUE): it passes through COMPLETING on its way back to the queue.
        return None if self._on_its_way_back(job_id) else refused

    def _on_its_way_back(self, job_id: str, wait_s: float = 10.0) -> bool:
        deadline = self.clock.monotonic() + wait_s
        while self.clock.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in WAITING:
                return True
            if state not in ("COMPLETING", "RUNNING"):
                return False
            self.clock.sleep(0.5)
        return False

    def start_step(self, argv: list[str], *, env: Mapping[str, str], report: Path | None = None):
        return self.runner.start(argv, env=env, report=report)


IN_SERVICE = ("idle", "mixed", "allocated", "completing")
"""sinfo states of a node that Slurm schedules jobs on (no `*`: it answers; not down,
drained or draining)."""


def _transient(said: str) -> bool:
    """A refusal that says nothing about the job: the controller did not answer, or the
    command was killed by a signal (the SIGTERM of a requeue reaches the driver's children)."""
    said = said.lower()
    if said.startswith("exit code -"):
        return True
    return any(s in said for s in TRANSIENT)


# --- pure parsers ------------------------------------------------------------------------
def parse_kv_line(line: str) -> dict[str, str]:
    """`scontrol show ... -o` prints one `Key=Value Key=Value` line per record."""
    out = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


def parse_time_min(text: str) -> float | None:
    """Slurm time (`UNLIMITED`, `30`, `1:00:00`, `2-00:00:00`) in minutes; None for unlimited."""
    if text in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [int(p) for p in text.split(":")]
    if len(parts) == 1:
        minutes = parts[0]
        return days * 1440 + minutes
    if len(parts) == 2:  # MM:SS
        return days * 1440 + parts[0] + parts[1] / 60
    h, m, s = parts[-3:]
    return days * 1440 + h * 60 + m + s / 60


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    total_nodes: int
    max_time_min: float | None
    state: str
    allow_groups: tuple[str, ...] | None = None
    """The groups whose members it admits (AllowGroups); None: every user."""


def parse_partitions(text: str) -> list[Partition]:
    parts = []
    for line in text.splitlines():
        kv = parse_kv_line(line)
        if "PartitionName" not in kv:
            continue
        parts.append(
            Partition(
                name=kv["PartitionName"],
                default=kv.get("Default") == "YES",
                total_nodes=int(kv.get("TotalNodes", "0")),
                max_time_min=parse_time_min(kv.get("MaxTime", "UNLIMITED")),
                state=kv.get("State", "UP"),
                allow_groups=None if kv.get("AllowGroups", "ALL") == "ALL" else tuple(kv["AllowGroups"].split(",")),
            )
        )
    return parts


def check_fits(parts: list[Partition], *, partition: str | None, nodes: int, time_min: int,
               spare_nodes: int = 0) -> Partition:
    """The login-node check: a job that could never start is an error now, not a job
    pending forever. The job asks for its spare nodes too."""
    names = ", ".join(p.name for p in parts) or "none"
    if partition is None:
        chosen = next((p for p in parts if p.default), None)
        if chosen is None:
            raise UserError(f"cluster.partition is unset and the cluster has no default partition; choose one of: {names}")
    else:
        chosen = next((p for p in parts if p.name == partition), None)
        if chosen is None:
            raise UserError(f"cluster.partition={partition}: no such partition (available: {names})")
    where = f"partition {chosen.name}"
    if nodes + spare_nodes > chosen.total_nodes:
        asked = f"nodes={nodes} + spare_nodes={spare_nodes} = {nodes + spare_nodes}" if spare_nodes else f"nodes={nodes}"
        raise UserError(
            f"{asked}: {where} has only {chosen.total_nodes} node(s); ask for at most {chosen.total_nodes}"
        )
    if chosen.max_time_min is not None and time_min > chosen.max_time_min:
        raise UserError(
            f"cluster.time_min={time_min}: {where} allows at most {chosen.max_time_min:g} minutes per job"
        )
    if not chosen.state.startswith("UP"):
        raise UserError(f"cluster.partition={chosen.name}: the partition is {chosen.state}, not UP")
    return chosen


# --- the same calls with the real Slurm, for callers that hold no Slurm object -----------
def partitions() -> list[Partition]:
    return Slurm(retry_s=LOGIN_RETRY_S).partitions()


def job_state(job_id: str, *, retry_s: float = LOGIN_RETRY_S) -> str | None:
    return Slurm(retry_s=retry_s).job_state(job_id)


def expand_nodelist(nodelist: str) -> list[str]:
    return Slurm().expand_nodelist(nodelist)
