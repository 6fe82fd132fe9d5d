"""The Slurm seam (dtk.launch.slurmctl) and its users on the login node, against a fake
Slurm in fake time: retries of transient failures, final answers, the bound, and how
`submit.wait` (launch.follow) and `dtk.status` report a Slurm that does not answer."""

from __future__ import annotations

import copy
import subprocess
import time
from pathlib import Path

import pytest

from dtk.common.errors import UserError
from dtk.common.rundir import RunDir, write_json_atomic
from dtk.config.compose import compose
from dtk.launch.launch import follow
from dtk.launch.slurmctl import RETRY_S, Runner, Slurm, SlurmUnavailable
from dtk.plan.plan import make_plan
from dtk.report.collect import collect
from dtk.status import render
from fake_slurm import SOCKET_TIMEOUT, FakeClock, FakeSlurm


def slurm(state: str | None = "RUNNING", retry_s: float = RETRY_S) -> tuple[Slurm, FakeSlurm, FakeClock]:
    clock = FakeClock()
    fake = FakeSlurm(clock, ["node1", "node2"], [])
    fake.state = state
    return Slurm(fake, clock, retry_s=retry_s), fake, clock


def test_job_state_comes_from_squeue_then_scontrol_and_a_forgotten_job_is_none():
    s, fake, clock = slurm("RUNNING")
    assert s.job_state("42") == "RUNNING"
    fake.state = None
    assert s.job_state("42") is None and clock.slept == 0  # "Invalid job id" is an answer, not a failure
    assert s.job_nodes("42") is None


def test_a_transient_failure_is_retried_with_growing_pauses():
    s, fake, clock = slurm("PENDING")
    fake.fail_next["squeue"] = 3
    assert s.job_state("42") == "PENDING" and clock.slept == 1 + 2 + 4


def test_a_host_without_a_slurm_configuration_is_answered_at_once_not_retried():
    class Unconfigured(Runner):
        calls = 0

        def run(self, argv, *, timeout=30):
            Unconfigured.calls += 1
            return subprocess.CompletedProcess(argv, 1, "", "scontrol: error: _establish_config_source: failed to fetch"
                                               " config\nscontrol: fatal: Could not establish a configuration source\n")

    clock = FakeClock()
    with pytest.raises(SlurmUnavailable, match="Could not establish a configuration source"):
        Slurm(Unconfigured(), clock, retry_s=60).job_state("7")
    assert Unconfigured.calls == 1 and clock.slept == 0


def test_a_command_that_hangs_counts_as_a_failed_attempt_until_the_bound():
    class Hanging(Runner):
        def run(self, argv, *, timeout=30):
            raise subprocess.TimeoutExpired(argv, timeout)

    clock = FakeClock()
    with pytest.raises(SlurmUnavailable, match=r"`squeue -h -j 7 -o %T` failed \d+ time\(s\) over 60 s; last: no answer"):
        Slurm(Hanging(), clock, retry_s=60).job_state("7")
    assert 45 <= clock.slept <= 60


def test_the_login_node_check_turns_an_unavailable_slurm_into_an_error_line():
    s, fake, _ = slurm(retry_s=10)
    fake.fail_next["scontrol"] = 100
    with pytest.raises(UserError, match="cannot ask Slurm for its partitions: .*Socket timed out"):
        s.partitions()


def test_a_missing_slurm_program_is_a_user_error():
    with pytest.raises(UserError, match="`dtk-no-such-program` is not on PATH"):
        Runner().run(["dtk-no-such-program"])


@pytest.fixture(scope="module")
def plan_config():
    return compose(["cluster=lab", "nodes=1", "tasks_per_node=1", "train.steps=20", "train.log_every=10"])


def run_of(tmp_path: Path, cfg):
    cfg = copy.deepcopy(cfg)
    cfg.run.root = str(tmp_path)
    plan = make_plan(cfg)
    run = RunDir(Path(plan.run_dir))
    run.path.mkdir(parents=True)
    run.plan_json.write_text(plan.to_json())
    return plan, run


class Answers(Runner):
    """squeue answers in order: a state, "fail" (slurmctld busy) or None (job forgotten)."""

    def __init__(self, answers: list[str | None], at_end=None) -> None:
        self.answers, self.at_end = list(answers), at_end

    def run(self, argv, *, timeout=30):
        answer = self.answers.pop(0) if argv[0] == "squeue" else None
        if answer == "fail":
            return subprocess.CompletedProcess(argv, 1, "", SOCKET_TIMEOUT)
        if answer is None:
            if self.at_end:
                self.at_end()
            return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id specified")
        return subprocess.CompletedProcess(argv, 0, answer + "\n", "")


def test_submit_wait_rides_out_transient_failures_and_reports_the_finish(tmp_path, plan_config, capsys):
    plan, run = run_of(tmp_path, plan_config)
    finished = {"status": "finished", "final_step": 20, "final_loss": 1.5}
    runner = Answers(["PENDING", "fail", "RUNNING", "fail", "fail", "RUNNING", None],
                     at_end=lambda: write_json_atomic(run.summary, finished))
    clock = FakeClock()
    assert follow(plan, run, "42", slurm=Slurm(runner, clock)) == 0
    out = capsys.readouterr().out
    assert "job 42: PENDING" in out and "job 42: RUNNING" in out and "finished:" in out
    assert clock.slept == 3 * 2 + 1 + 1 + 2  # three pauses between polls, three retries


def test_submit_wait_ends_with_an_error_line_when_slurm_stays_silent(tmp_path, plan_config, capsys):
    plan, run = run_of(tmp_path, plan_config)
    s, fake, clock = slurm("RUNNING")
    fake.fail_next["squeue"] = 10**6
    assert follow(plan, run, "42", slurm=s) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: stopped following job 42, Slurm does not answer:")
    assert f"python -m dtk.status {run.path}" in err[0] and clock.slept <= RETRY_S


def test_status_says_unknown_when_slurm_does_not_answer(tmp_path, plan_config):
    _, run = run_of(tmp_path, plan_config)
    run.event("submitted", cluster="slurm", job_id="42")
    run.event("started", restart=0, job_id="42", nodes=["node1"], world_size=1)
    s, fake, _ = slurm("RUNNING", retry_s=10)
    assert collect(run, slurm=s)["state"] == "running"
    fake.fail_next["squeue"] = 100
    info = collect(run, slurm=s)
    assert info["state"] == "unknown" and "Socket timed out" in info["slurm_error"]
    assert "slurm        did not answer:" in render(info)


def test_a_step_s_own_messages_reach_the_report_file_and_the_driver_log(tmp_path, capfd):
    report = tmp_path / "srun.log"
    proc = Runner().start(["sh", "-c", "echo 'srun: error: node2: task 1: Killed' >&2; exit 1"], env={"PATH": "/usr/bin:/bin"},
                          report=report)
    assert proc.wait(timeout=10) == 1
    for _ in range(100):  # the copying thread ends at EOF, just after the process
        if report.exists() and report.read_text():
            break
        time.sleep(0.02)
    assert report.read_text() == "srun: error: node2: task 1: Killed\n"
    assert "srun: error: node2: task 1: Killed" in capfd.readouterr().err


class _ShowJob:
    """A runner whose `scontrol show job` prints one fixed line."""

    def __init__(self, line: str) -> None:
        self.line = line

    def run(self, argv):
        return subprocess.CompletedProcess(argv, 0, self.line + "\n", "")


@pytest.mark.parametrize(("fields", "cut"), [
    ("StartTime=2026-12-07T10:00:00 EndTime=2026-12-07T10:30:00 TimeLimit=00:30:00", False),  # its limit
    ("StartTime=2026-12-07T10:00:00 EndTime=2026-12-07T10:05:00 TimeLimit=00:05:00", False),  # a limit cut by scontrol
    ("StartTime=2026-12-07T10:00:00 EndTime=2026-12-07T10:02:10 TimeLimit=30:00", True),  # a preemption's grace time
    ("StartTime=2026-12-07T10:00:00 EndTime=2026-12-08T09:00:00 TimeLimit=1-00:00:00", True),
    ("StartTime=2026-12-07T10:00:00 EndTime=Unknown TimeLimit=UNLIMITED", False),
    ("EndTime=2026-12-07T10:02:10", False),  # fields missing: not taken for a preemption
])
def test_a_job_ended_before_its_own_limit_is_cut_short(fields, cut):
    from dtk.driver.timeleft import cut_short

    slurm = Slurm(_ShowJob(f"JobId=7 JobState=RUNNING {fields}"), retry_s=0)
    assert cut_short(slurm, "7") is cut
