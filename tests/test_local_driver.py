"""The local driver's decisions, against a fake clock and fake worker processes.

LocalDriver (dtk/driver/local.py) runs the start-decide loop of dtk/driver/core.py that
the Slurm Supervisor shares. Here its `spawn` starts `FakeWorker`s that play a `Start` in
fake time (beat the heartbeat, log steps, commit a checkpoint, exit, answer signals) inside
a real run directory, so each decision, the restart budget, a hang, a stop and a crash,
takes milliseconds. The real local runs are tests/test_spine.py (crash and hang on real
workers) and tests/test_stop.py (a stop on real workers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import run_main
from dtk.common.rundir import HEARTBEAT, RunDir
from dtk.common.storage import checkpoint_steps, checkpoints_of
from dtk.config.compose import compose
from dtk.driver.core import DriverCore, Silence, silence
from dtk.driver.decide import Action
from dtk.driver.local import POLL_S, LocalDriver
from dtk.driver.supervisor import Supervisor
from dtk.plan.plan import make_plan
from dtk.worker.codes import EXIT_CONFIG, EXIT_STOPPED
from fake_slurm import FakeClock

HOST = socket.gethostname()
CRASH_LOG = "Traceback (most recent call last):\n  ...\nRuntimeError: boom"
CONFIG_LOG = "error: data.path=/d: shard shard_00000.h5 does not match its crc32 in the manifest; prepare the dataset again"


@dataclass
class Start:
    """What the workers of one start do, in the fake clock's seconds."""

    exit: int | None = 0
    """Every rank's exit code once the start ends; None: they run until signalled (a hang,
    or a run that is stopped)."""
    ranks: dict[int, int] | None = None
    """Instead of `exit`: only these ranks end, with these codes; the others run on."""
    after_s: float = 5.0
    steps: int = 0
    """Training steps rank 0 logs to metrics.jsonl when the start ends or is stopped."""
    checkpoint: bool = False
    """Commit a checkpoint at the last logged step (on SIGTERM the workers always save)."""
    beat: bool = True
    stop_beating_s: float | None = None
    """Rank 0 stops beating this long after the start (a hang)."""
    logs: dict[int, str] | None = None
    """What each rank writes to its log when it ends (rank -> text)."""
    errors: dict[int, dict] | None = None
    """The record of the exception each rank died of (rank -> type, message, file, line), as
    dtk/worker/failure.py writes it when it ends."""
    at_s: dict[float, Callable[[], None]] | None = None
    """Things that happen while the start runs (a dtk.stop request), by seconds since it began."""
    logged: bool = False
    """Set once the first worker to end (or to stop) logged the start's steps."""


class FakeWorker:
    """One worker process, Popen-like: `poll` is where the fake time shows."""

    def __init__(self, start: Start, *, rank: int, env: dict[str, str], log: Path, clock: FakeClock,
                 run: RunDir) -> None:
        self.start, self.rank, self.env, self.log, self.clock, self.run = start, rank, env, log, clock, run
        self.t0 = clock.time()
        self.pid = 40000 + rank
        self.returncode: int | None = None
        self.signals: list[int] = []

    def _log_steps_and_save(self, save: bool) -> None:
        if self.start.logged:  # the start's steps are logged once, by the first worker to end
            return
        self.start.logged = True
        first = max(self.run.latest_metrics(), default=0) + 1
        last = first + self.start.steps - 1
        with open(self.run.metrics, "a") as fh:
            for step in range(first, last + 1):
                fh.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")
        if save and last >= first:
            folder = self.run.checkpoint_dir(last)
            folder.mkdir(parents=True)
            (folder / "manifest.json").write_text("{}")

    def _end(self, code: int) -> None:
        self._log_steps_and_save(self.start.checkpoint)
        if self.start.logs and self.rank in self.start.logs:
            self.log.write_text(self.start.logs[self.rank] + "\n")
        if self.start.errors and self.rank in self.start.errors:
            restart = int(self.env["DTK_RESTART"])
            path = self.run.worker_error(restart, self.rank)
            path.write_text(json.dumps({"rank": self.rank, "start": restart, **self.start.errors[self.rank]}))
        self.returncode = code

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        s, now = self.start, self.clock.time()
        if self.rank == 0:
            for at in sorted(s.at_s or {}):
                if now - self.t0 >= at:
                    s.at_s.pop(at)()
        code = s.exit if s.ranks is None else s.ranks.get(self.rank)
        if code is not None and now - self.t0 >= s.after_s:
            self._end(code)
        elif self.rank == 0 and s.beat and (s.stop_beating_s is None or now - self.t0 < s.stop_beating_s):
            beat = self.run.path / HEARTBEAT
            beat.touch()
            os.utime(beat, (now, now))
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)
        if self.returncode is not None:
            return
        if signum == signal.SIGTERM:  # the workers agree, save and stop
            self._log_steps_and_save(True)
            self.returncode = EXIT_STOPPED
        else:
            self.returncode = -signum

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            assert timeout is not None, "a fake worker that never ends was waited for without a timeout"
            self.clock.sleep(timeout)
            raise subprocess.TimeoutExpired(["dtk.worker"], timeout)
        return self.returncode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Local:
    """A run directory and the LocalDriver of a 2-worker run whose starts play `starts`."""

    def __init__(self, tmp_path: Path, starts: list[Start], *, overrides: tuple[str, ...] = (), **fault) -> None:
        fault = {"max_restarts": 2, "hang_timeout_s": 30, "startup_timeout_s": 120, **fault}
        overrides = ["tasks_per_node=2", "train.global_batch=32", f"run.root={tmp_path}", *overrides]
        self.plan = make_plan(compose(overrides + [f"fault.{k}={v}" for k, v in fault.items()]))
        self.run = RunDir(Path(self.plan.run_dir))
        self.run.path.mkdir(parents=True)
        self.run.plan_json.write_text(self.plan.to_json())
        self.clock = FakeClock()
        self.starts = list(starts)
        self.spawned: list[list[FakeWorker]] = []  # per start, its workers
        self.driver = LocalDriver(self.plan, self.run, clock=self.clock, spawn=self.spawn)

    def spawn(self, argv: list[str], *, env: dict[str, str], log: Path) -> FakeWorker:
        assert argv[-3:] == ["-m", "dtk.worker", str(self.run.path)], argv
        rank = int(env["DTK_RANK"])
        if rank == 0:
            assert self.starts, "the driver started the workers more often than the test planned"
            self.spawned.append([])
            self.current = self.starts.pop(0)
        worker = FakeWorker(self.current, rank=rank, env=env, log=log, clock=self.clock, run=self.run)
        self.spawned[-1].append(worker)
        return worker

    def events(self, name: str) -> list[dict]:
        return [e for e in self.run.events_list() if e["event"] == name]

    def summary(self) -> dict:
        return json.loads(self.run.summary.read_text())


def test_the_liveness_rule_counts_the_start_up_limit_before_the_first_beat_and_the_hang_limit_after():
    fault = make_plan(compose(["fault.hang_timeout_s=30", "fault.startup_timeout_s=120"])).config.fault
    assert silence(beat=0.0, started=100.0, now=190.0, fault=fault) == Silence(90.0, 120)
    assert silence(beat=99.0, started=100.0, now=190.0, fault=fault) == Silence(90.0, 120)  # a beat of an earlier start
    assert silence(beat=150.0, started=100.0, now=190.0, fault=fault) == Silence(40.0, 30)
    assert silence(beat=150.0, started=100.0, now=190.0, fault=fault).hung
    assert not silence(beat=0.0, started=100.0, now=220.0, fault=fault).hung  # exactly the limit is not over it
    assert Silence(40.4, 30).cause() == "no heartbeat for 40 s (limit 30 s)"


def test_both_drivers_are_backends_of_one_core_that_carries_out_every_action():
    assert issubclass(LocalDriver, DriverCore) and issubclass(Supervisor, DriverCore)
    for action in Action:
        assert callable(getattr(DriverCore, f"on_{action.value}", None)), f"DriverCore has no on_{action.value}"
        assert callable(getattr(Supervisor, f"on_{action.value}")), action


def test_a_finished_start_ends_the_run_with_0_and_one_start(tmp_path):
    job = Local(tmp_path, [Start(exit=0, steps=5)])
    assert job.driver.run_to_end() == 0
    (started,) = job.events("started")
    assert started["restart"] == 0 and started["world_size"] == 2 and started["nodes"] == [HOST]
    assert [w.env["DTK_RANK"] for w in job.spawned[0]] == ["0", "1"]
    assert all(w.env["DTK_RESTART"] == "0" and w.env["DTK_RECOVERY_FROM"] == "" for w in job.spawned[0])
    assert job.events("relaunched") == [] and job.events("failed") == []
    pids = (job.run.log_dir(0) / "pids").read_text().split()
    assert pids == ["40000", "40001"]


def test_a_crash_kills_the_other_workers_and_relaunches_from_the_last_checkpoint(tmp_path, capsys):
    job = Local(tmp_path, [Start(ranks={1: 1}, steps=4, checkpoint=True, logs={1: CRASH_LOG}), Start(exit=0, steps=2)])
    assert job.driver.run_to_end() == 0
    first, second = job.spawned
    assert first[0].signals == [signal.SIGKILL] and first[1].signals == []  # the survivor cannot save alone
    (relaunched,) = job.events("relaunched")
    assert relaunched["cause"] == "crashed" and relaunched["detail"] == f"worker rank 1 on {HOST} exit code 1"
    assert relaunched["attempt"] == 1 and relaunched["resume_from"] == 4 and relaunched["step"] == 4
    assert relaunched["rank"] == 1 and relaunched["exit_code"] == 1 and relaunched["last_line"] == "RuntimeError: boom"
    # The relaunch is start 1 and measures its recovery from when the crash was seen.
    assert all(w.env["DTK_RESTART"] == "1" for w in second)
    recovery_from = float(second[0].env["DTK_RECOVERY_FROM"])
    assert first[0].t0 + 5.0 <= recovery_from <= first[0].t0 + 5.0 + POLL_S
    assert "relaunching (crashed: worker rank 1" in capsys.readouterr().err


def test_of_two_ends_seen_at_once_the_death_by_a_signal_is_the_cause(tmp_path):
    """Rank 1 is killed and rank 0 fails on the broken connection; the driver sees both in one
    poll. The kill is the cause: a peer's death ends a worker with an exception, not a signal."""
    job = Local(tmp_path, [Start(ranks={0: 1, 1: -9}, logs={0: CRASH_LOG}), Start(exit=0)])
    assert job.driver.run_to_end() == 0
    (relaunched,) = job.events("relaunched")
    assert relaunched["rank"] == 1 and relaunched["detail"] == f"worker rank 1 on {HOST} killed by SIGKILL"


def test_the_restart_budget_counts_crashes_and_hangs_and_then_fails_with_the_last_cause(tmp_path, capsys):
    starts = [Start(exit=1, logs={0: CRASH_LOG}), Start(exit=None, stop_beating_s=10), Start(exit=-9)]
    job = Local(tmp_path, starts, max_restarts=2)
    assert job.driver.run_to_end() == 1
    assert len(job.spawned) == 3 and job.starts == []  # no fourth start
    assert [e["cause"] for e in job.events("relaunched")] == ["crashed", "hung"]
    (failed,) = job.events("failed")
    assert failed["error"] == (f"crashed 3 times in job {job.driver.job_id} (fault.max_restarts=2);"
                               f" last cause: worker rank 0 on {HOST} killed by SIGKILL")
    summary = job.summary()
    assert summary["status"] == "failed" and summary["restarts"] == 2 and summary["error"] == failed["error"]
    err = capsys.readouterr().err
    assert err.rstrip().splitlines()[-1].startswith(f"error: {failed['error']}. Log: ")


def test_a_start_whose_heartbeat_stops_is_a_hang_killed_and_relaunched(tmp_path):
    job = Local(tmp_path, [Start(exit=None, stop_beating_s=10), Start(exit=0)])
    assert job.driver.run_to_end() == 0
    hung, again = job.spawned
    (found,) = job.events("hang_detected")
    # The last beat was just before 10 s; the hang limit (30 s) counts from it (the event
    # rounds to 0.1 s), and the relaunch came once it was over, not before.
    assert found["limit_s"] == 30 and 30 <= found["silent_s"] <= 30 + 2 * POLL_S
    assert 10 - POLL_S + 30 < again[0].t0 - hung[0].t0 <= 10 + 30 + 2 * POLL_S
    assert [w.signals for w in hung] == [[signal.SIGKILL], [signal.SIGKILL]]
    (relaunched,) = job.events("relaunched")
    assert relaunched["cause"] == "hung" and relaunched["detail"].startswith("no heartbeat for 3")


def test_a_start_that_never_beats_is_a_hang_after_the_start_up_limit(tmp_path):
    job = Local(tmp_path, [Start(exit=None, beat=False), Start(exit=0)])
    assert job.driver.run_to_end() == 0
    silent, again = job.spawned
    (found,) = job.events("hang_detected")
    assert found["limit_s"] == 120 and 120 <= found["silent_s"] <= 120 + 2 * POLL_S
    assert 120 < again[0].t0 - silent[0].t0 <= 120 + 2 * POLL_S


def test_a_stop_request_has_the_workers_save_and_ends_the_run_stopped(tmp_path, capsys):
    def ask():
        job.run.stop_request.write_text(json.dumps({"by": "alice", "now": False}))

    job = Local(tmp_path, [Start(exit=None, steps=3, at_s={3.0: ask})])
    assert job.driver.run_to_end() == EXIT_STOPPED
    assert [w.signals for w in job.spawned[0]] == [[signal.SIGTERM], [signal.SIGTERM]]
    (stopped,) = job.events("stopped")
    assert stopped["by"] == "dtk.stop by alice" and stopped["checkpoint"] == 3
    assert job.summary()["status"] == "stopped" and job.summary()["stopped_by"] == "dtk.stop by alice"
    assert not job.run.stop_request.exists() and job.events("relaunched") == []
    assert "run the same command to continue from checkpoint step 3" in capsys.readouterr().out


def test_a_stop_now_kills_the_workers_without_a_save(tmp_path):
    def ask():
        job.run.stop_request.write_text(json.dumps({"by": "bob", "now": True}))

    job = Local(tmp_path, [Start(exit=None, steps=3, at_s={1.0: ask})])
    assert job.driver.run_to_end() == EXIT_STOPPED
    assert [w.signals for w in job.spawned[0]] == [[signal.SIGKILL], [signal.SIGKILL]]
    (stopped,) = job.events("stopped")
    assert stopped["by"] == "dtk.stop by bob --now" and stopped["checkpoint"] is None
    assert checkpoint_steps(checkpoints_of(job.run)) == []


@pytest.mark.parametrize("code", [EXIT_STOPPED, 0])
def test_workers_that_stop_on_a_signal_of_their_own_end_the_run_without_a_relaunch(tmp_path, code):
    job = Local(tmp_path, [Start(exit=code, steps=2, checkpoint=True)])
    assert job.driver.run_to_end() == (EXIT_STOPPED if code == EXIT_STOPPED else 0)
    assert job.events("relaunched") == []
    if code == EXIT_STOPPED:
        assert job.events("stopped")[0]["by"] == "a signal to the workers"


def test_a_configuration_error_fails_at_once_even_with_relaunches_left(tmp_path, capsys):
    # Rank 1 finds the error and exits 2; rank 0 then fails too (its peer left): the
    # configuration error is the cause, and starting again cannot fix it.
    job = Local(tmp_path, [Start(ranks={0: 1, 1: EXIT_CONFIG}, logs={0: CRASH_LOG, 1: CONFIG_LOG})], max_restarts=2)
    assert job.driver.run_to_end() == EXIT_CONFIG
    assert len(job.spawned) == 1 and job.events("relaunched") == []
    (failed,) = job.events("failed")
    assert failed["error"] == CONFIG_LOG.removeprefix("error: ") and failed["rank"] == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"{CONFIG_LOG} (worker rank 1; log {job.run.log_dir(0) / 'rank_1.log'})"


VIEW_ERROR = {"type": "RuntimeError", "file": "/home/alice/proj/loss.py", "line": 12,
              "message": "view size is not compatible with input tensor's size and stride (at least one dimension"
                         " spans across two contiguous subspaces). Use .reshape(...) instead."}


def test_the_same_error_in_user_code_at_two_starts_fails_the_run_after_the_second(tmp_path, capsys):
    bug = {0: VIEW_ERROR, 1: VIEW_ERROR}
    job = Local(tmp_path, [Start(exit=1, steps=3, errors=bug), Start(exit=1, errors=bug), Start(exit=0)], max_restarts=3)
    assert job.driver.run_to_end() == 1
    assert len(job.spawned) == 2 and len(job.events("relaunched")) == 1  # not the third start
    (event,) = job.events("user_code_error")
    assert {k: event[k] for k in ("type", "message", "file", "line", "step", "rank")} == {**VIEW_ERROR, "step": 3,
                                                                                       "rank": 0}
    (failed,) = job.events("failed")
    assert failed["error"].startswith("the same exception in user code ended two starts in a row without"
                                      " progress; not relaunched (job local-")
    assert failed["error"].endswith("RuntimeError: view size is not compatible with input tensor's size and stride"
                                    " (at least one dimension spans across two contiguous subspaces). Use"
                                    " .reshape(...) instead. at /home/alice/proj/loss.py:12 (step 3)")
    assert job.summary()["status"] == "failed" and job.summary()["error"] == failed["error"]
    (line,) = capsys.readouterr().err.strip().splitlines()[1:]  # after the relaunch line of the first crash
    assert line == f"error: {failed['error']}; log {job.run.log_dir(1) / 'rank_0.log'}"
    assert "again" not in line and "resume" not in line


@pytest.mark.parametrize("second", [
    {"errors": {0: {**VIEW_ERROR, "line": 13}}},  # raised from another line
    {"errors": {0: {**VIEW_ERROR, "message": "CUDA error: an illegal memory access"}}},  # another message
    {"errors": {0: {**VIEW_ERROR, "type": "ValueError"}}},
    {"errors": {0: VIEW_ERROR}, "steps": 2},  # the same error, but at a later step: progress between
    {"errors": {0: {**VIEW_ERROR, "file": None, "line": None}}},  # no frame of the user's (a lost peer)
    {"errors": None},  # no record: killed by a signal, a segfault
], ids=["line", "message", "type", "progress", "not-user-code", "no-record"])
def test_a_fault_that_differs_between_starts_is_relaunched(tmp_path, second):
    first = Start(exit=1, steps=3, errors={0: VIEW_ERROR})
    job = Local(tmp_path, [first, Start(exit=1, **second), Start(exit=0)], max_restarts=3)
    assert job.driver.run_to_end() == 0
    assert len(job.spawned) == 3 and len(job.events("relaunched")) == 2
    assert job.events("user_code_error") == [] and job.events("failed") == []


def test_the_same_error_after_a_start_that_was_not_a_crash_is_relaunched(tmp_path):
    """Between the two crashes a start hung: the second crash is compared with the hang's
    start, which died of no exception, so it is relaunched."""
    bug = {0: VIEW_ERROR}
    starts = [Start(exit=1, errors=bug), Start(exit=None, stop_beating_s=10), Start(exit=1, errors=bug),
              Start(exit=0)]
    job = Local(tmp_path, starts, max_restarts=3)
    assert job.driver.run_to_end() == 0
    assert [e["cause"] for e in job.events("relaunched")] == ["crashed", "hung", "crashed"]


def test_a_relaunch_restored_from_memory_names_the_step_the_workers_loaded_as_status_does(tmp_path, capsys):
    """With checkpoint.memory_every the workers choose at the start where they resume (the
    newest snapshot, else the disk): the relaunch line and event do not name the disk step
    as the resume point, and the step is said once the workers loaded it, from the same
    event dtk.status reads."""
    def loaded():  # what the relaunched workers write: their snapshot of step 4, then ready
        job.run.event("checkpoint_loaded", step=4, tier="memory", seconds=0.1)
        job.run.event("ready", step=4, restart=1)

    starts = [Start(exit=1, steps=5, logs={0: CRASH_LOG}), Start(exit=0, steps=3, at_s={1.0: loaded})]
    job = Local(tmp_path, starts, overrides=("checkpoint.memory_every=2",))
    assert job.driver.run_to_end() == 0
    (relaunched,) = job.events("relaunched")
    assert relaunched["resume_from"] is None and relaunched["disk_checkpoint"] == 0  # no checkpoint on disk
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"relaunching (crashed: worker rank 0 on {HOST} exit code 1); from the newest in-memory"
                      " snapshot, else checkpoint step 0 on disk, 1 relaunch(es) left")
    assert err[1] == "resumed from step 4 (memory)"
    status = run_main("dtk.status", str(job.run.path), "--json")
    assert status.returncode == 0, status.stderr
    second = json.loads(status.stdout)["starts"][1]
    assert second["resumed_from"] == 4 and second["tier"] == "memory"

