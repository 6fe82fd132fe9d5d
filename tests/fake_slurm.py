"""A fake Slurm and a clock that tests move forward, for the driver's decisions.

`FakeSlurm` answers the commands dtk.launch.slurmctl sends (scontrol, squeue, scancel)
from a little state (the job's nodes and state), and `srun` with a `FakeStep` that plays a
`Script`: it beats the heartbeat, commits checkpoints, writes metrics, events and log lines
into the real run directory, as the workers would, in the fake clock's time. Nothing here
is a substitute for the lab tests (tests/test_faults.py): it makes every branch of the
decision table reachable in milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dtk.common.rundir import HEARTBEAT, RunDir
from dtk.launch.slurmctl import Clock

SOCKET_TIMEOUT = "slurm_load_jobs error: Socket timed out on send/recv operation"


class FakeClock(Clock):
    """Wall and monotonic time in one number, from a fixed start; sleeping moves it forward
    at once (and runs `on_sleep` hooks)."""

    def __init__(self, start: float = 1.8e9) -> None:
        self.start = self.now = start
        self.slept = 0.0
        self.on_sleep: list[Callable[[], None]] = []

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds
        for hook in self.on_sleep:
            hook()


@dataclass
class Script:
    """What one start of the workers does, in the fake clock's seconds."""

    exit: int | None = 0
    """srun's exit code once the step ends; None: it never ends by itself (a hang)."""
    after_s: float = 5.0
    """How long the step runs."""
    steps: int = 0
    """Training steps logged to metrics.jsonl during the start (from the last one on)."""
    checkpoint: bool = False
    """Commit a checkpoint at the last logged step."""
    beat: bool = True
    """Beat the heartbeat while running (False: silent from the start, or from `stop_beating_s`)."""
    stop_beating_s: float | None = None
    preempted: bool = False
    """The workers write a `preempted` event (they saved on a signal) before exiting."""
    driver_signal: int | None = None
    """Deliver this signal to the driver while the step runs."""
    lose: tuple[str, ...] = ()
    """Nodes that leave the job (Slurm set them DOWN) when the step ends."""
    log: str = ""
    """Lines rank 0 writes to its log."""
    logs: dict[int, str] | None = None
    """Lines each rank writes to its log (rank -> text)."""
    srun_report: str = ""
    """What srun itself prints when the step ends (which task died first, which it then ended)."""
    unkillable: bool = False
    """srun does not end when its step is cancelled (the driver must kill srun)."""
    first_step: bool = False
    """Log this start's first step at once (its metrics line), then the rest at the end."""
    at_s: dict[float, Callable[[], None]] | None = None
    """Things that happen while the step runs, by seconds since its start (a scancel, a
    dtk.stop request), each once."""


class FakeStep:
    """A worker step: the Popen-like handle `Runner.start` returns."""

    def __init__(self, fake: FakeSlurm, script: Script, argv: list[str]) -> None:
        self.fake, self.script, self.argv = fake, script, argv
        self.run = RunDir(Path(argv[-1]))
        self.logs = Path(next(a for a in argv if a.startswith("--output=")).split("=", 1)[1]).parent
        self.t0 = fake.clock.time()
        self.returncode: int | None = None
        self.cancelled = False
        self.signalled = False
        self.killed = False
        self.env: dict[str, str] = {}
        self.report: Path | None = None  # where the driver collects srun's own messages
        self.stop_signals: list[str] = []
        self.first_logged = False

    def _beat(self) -> None:
        s, now = self.script, self.fake.clock.time()
        silent = not s.beat or (s.stop_beating_s is not None and now - self.t0 >= s.stop_beating_s)
        if not silent:
            path = self.run.path / HEARTBEAT
            path.touch()
            os.utime(path, (now, now))

    def _end(self, code: int) -> None:
        s = self.script
        first = max(self.run.latest_metrics(), default=0) + 1
        with open(self.run.metrics, "a") as fh:
            for step in range(first, first + s.steps):
                fh.write(json.dumps({"step": step, "loss": 1.0 / step, "restart": self.fake.num_starts - 1}) + "\n")
        last = first + s.steps - 1
        if s.checkpoint and s.steps:
            folder = self.run.checkpoint_dir(last)
            folder.mkdir(parents=True)
            (folder / "manifest.json").write_text("{}")
        if s.preempted:
            self.run.event("preempted", step=last, signal="SIGUSR2")
        if s.log:
            (self.logs / "rank_0.log").write_text(s.log + "\n")
        for rank, text in (s.logs or {}).items():
            (self.logs / f"rank_{rank}.log").write_text(text + "\n")
        if s.srun_report and self.report is not None:
            self.report.write_text(s.srun_report + "\n")
        for node in s.lose:
            self.fake.nodes.remove(node)
        self.returncode = code

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self.script.first_step and not self.first_logged:
            self.first_logged = True
            step = max(self.run.latest_metrics(), default=0) + 1
            with open(self.run.metrics, "a") as fh:
                fh.write(json.dumps({"step": step, "loss": 1.0 / step, "restart": self.fake.num_starts - 1}) + "\n")
        if self.stop_signals:  # the workers agree, save and stop (exit 3)
            self.script.checkpoint, self.script.preempted = True, True
            self._end(3)
            return self.returncode
        for at in sorted(self.script.at_s or {}):
            if self.fake.clock.time() - self.t0 >= at:
                self.script.at_s.pop(at)()
        if self.script.driver_signal and not self.signalled:
            self.signalled = True
            self.fake.deliver(self.script.driver_signal)
        if self.cancelled and not self.script.unkillable:
            self._end(137)
        elif self.script.exit is not None and self.fake.clock.time() - self.t0 >= self.script.after_s:
            self._end(self.script.exit)
        else:
            self._beat()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            if timeout is None:
                raise AssertionError("a fake step that never ends was waited for without a timeout")
            self.fake.clock.sleep(timeout)
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return self.returncode

    def kill(self) -> None:
        self.killed = True
        if self.returncode is None:
            self.returncode = -9


class HealthJob:
    """A returning node's health job (srun of its own): passes after a second, writing its
    heartbeat as the probe would, unless told to fail."""

    def __init__(self, argv: list[str], clock: FakeClock, passes: bool, env) -> None:
        self.argv, self.clock, self.passes, self.env = argv, clock, passes, dict(env)
        self.node = next(a for a in argv if a.startswith("--nodelist=")).split("=", 1)[1]
        self.t0 = clock.time()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.clock.time() - self.t0 >= 1.0:
            if self.passes:
                Path(self.argv[-2]).write_text(json.dumps({"node": self.node, "time": self.clock.time()}))
            self.returncode = 0 if self.passes else 1
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9


class FakeSlurm:
    """One job, `job_id`, holding `nodes`; answers like Slurm 22.05. `fail_next[cmd] = n`
    makes the next n calls of `cmd` (`squeue`, `scontrol`, or two words: `scontrol requeue`)
    fail as when slurmctld does not answer."""

    def __init__(self, clock: FakeClock, nodes: list[str], scripts: list[Script], job_id: str = "42") -> None:
        self.clock, self.nodes, self.scripts, self.job_id = clock, list(nodes), list(scripts), job_id
        self.state = "RUNNING"
        self.reason = "None"
        self.restarts = 0
        self.calls: list[list[str]] = []
        self.steps: list[FakeStep] = []
        self.fail_next: dict[str, int] = {}
        self.requeue_refusal: str | None = None
        self.update_refusal: str | None = None
        self.state_after_refusal: str | None = None
        self.excluded: list[str] = []
        self.held = False
        self.health_jobs: list[HealthJob] = []
        self.health_passes = True
        self.end_time: float | None = None  # the job's time limit, in the fake clock
        self.node_states: dict[str, str] = {n: "allocated" for n in nodes}
        self.signal_handler: Callable[[int], None] | None = None

    @property
    def num_starts(self) -> int:
        return len(self.steps)

    @property
    def srun_calls(self) -> list[list[str]]:
        return [s.argv for s in self.steps]

    def scancel(self) -> None:
        """`scancel JOB` as Slurm 22.05 does it: the job shows COMPLETING at once, its
        steps and its batch script (the driver) get SIGTERM."""
        self.state = "COMPLETING"
        for step in self.steps:
            step.stop_signals.append("TERM")
        self.deliver(15)

    def deliver(self, signum: int) -> None:
        assert self.signal_handler is not None, "no driver listens for signals"
        self.signal_handler(signum)

    # --- the Runner interface -----------------------------------------------------------
    def run(self, argv: list[str], *, timeout: float = 30) -> subprocess.CompletedProcess:
        self.calls.append(list(argv))
        for key in (" ".join(argv[:2]), argv[0]):
            if self.fail_next.get(key, 0) > 0:
                self.fail_next[key] -= 1
                return subprocess.CompletedProcess(argv, 1, "", SOCKET_TIMEOUT + "\n")
        return subprocess.CompletedProcess(argv, *self._answer(argv))

    def start(self, argv: list[str], *, env, report: Path | None = None) -> FakeStep | HealthJob:
        assert argv[0] == "srun", argv
        if "--job-name=dtk-health" in argv:
            job = HealthJob(argv, self.clock, self.health_passes, env)
            self.health_jobs.append(job)
            return job
        assert self.scripts, f"start {self.num_starts} has no script"
        step = FakeStep(self, self.scripts.pop(0), argv)
        step.env, step.report = dict(env), report
        self.steps.append(step)
        return step

    def _end_time(self) -> str:
        if self.end_time is None:
            return "Unknown"
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.end_time))

    def _answer(self, argv: list[str]) -> tuple[int, str, str]:
        job = self.job_id
        gone = self.state is None
        match argv:
            case ["scontrol", "show", "job", j, "-o"] if j == job and not gone:
                return 0, (f"JobId={job} JobState={self.state} Reason={self.reason} Restarts={self.restarts}"
                           f" NodeList={','.join(self.nodes) or '(null)'}"
                           f" ExcNodeList={','.join(self.excluded) or '(null)'} Partition=debug"
                           f" EndTime={self._end_time()}\n"), ""
            case ["sinfo", "-h", "-N", "-o", "%N %T", *_]:
                return 0, "".join(f"{n} {s}\n" for n, s in self.node_states.items()), ""
            case ["scancel", signal_flag, step] if signal_flag.startswith("--signal=") and signal_flag != "--signal=KILL":
                self.steps[int(step.split(".")[1])].stop_signals.append(signal_flag.split("=", 1)[1])
                return 0, "", ""
            case ["scontrol", "show", "hostnames", nodelist]:
                return 0, "\n".join(nodelist.split(",")) + "\n", ""
            case ["squeue", "-h", "-j", j, "-o", "%T"] if j == job and not gone:
                return 0, f"{self.state}\n", ""
            case ["squeue", "-h", "-s", "-j", j, "-o", "%i"] if j == job and not gone:
                live = [f"{job}.{i}" for i, s in enumerate(self.steps) if s.returncode is None]
                return 0, "\n".join([f"{job}.batch", *live]) + "\n", ""
            case ["scontrol" | "squeue", *_] if gone or job not in " ".join(argv):
                return 1, "", "slurm_load_jobs error: Invalid job id specified\n"
            case ["scancel", "--signal=KILL", step]:
                self.steps[int(step.split(".")[1])].cancelled = True
                return 0, "", ""
            case ["scontrol", "update", j, exc] if j == f"JobId={job}" and exc.startswith("ExcNodeList="):
                if self.update_refusal:
                    return 1, "", self.update_refusal + "\n"
                if self.state != "PENDING":  # as Slurm: only a pending job takes ExcNodeList
                    return 1, "", f"Job is no longer pending execution for job {job}\n"
                self.excluded = [n for n in exc.split("=", 1)[1].split(",") if n]
                return 0, "", ""
            case ["scontrol", "requeue" | "requeuehold" as how, j] if j == job:
                if self.requeue_refusal:
                    self.state = self.state_after_refusal or self.state
                    return 1, "", self.requeue_refusal + "\n"
                self.state, self.held = "PENDING", how == "requeuehold"
                return 0, "", ""
            case ["scontrol", "release", j] if j == job:
                self.held = False
                return 0, "", ""
        raise AssertionError(f"the fake Slurm does not know {argv}")
