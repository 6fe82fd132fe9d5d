"""The Slurm driver's decision table, every branch, against a fake Slurm in fake time.

Each test plays one or more starts of the workers (tests/fake_slurm.py `Script`) through
the real Supervisor, which writes into a real run directory; the lab tests
(tests/test_faults.py, tests/test_slurm.py) prove the same paths on a real Slurm.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import signal
from pathlib import Path

import pytest

from dtk.common.rundir import RunDir
from dtk.config.compose import compose
from dtk.config.schema import Config
from dtk.driver.decide import Action, Facts, Kind, Outcome, UserFault, classify, decide
from dtk.driver.exclusions import add_exclusions, read_exclusions, readmit
from dtk.driver.record import record_failure
from dtk.driver.supervisor import DriverFailed, Supervisor, drive
from dtk.launch.slurmctl import RETRY_S, Slurm, SlurmUnavailable
from dtk.plan.plan import make_plan
from dtk.worker.codes import EXIT_CONFIG, EXIT_STOPPED
from fake_slurm import FakeClock, FakeSlurm, Script

CRASH_LOG = "Traceback (most recent call last):\n  ...\nRuntimeError: boom"
CONFIG_LOG = "error: data.path=/d: shard shard_00000.h5 does not match its crc32 in the manifest; prepare the dataset again"


@pytest.fixture(scope="module")
def base_config():
    return compose(["cluster=lab", "nodes=2", "tasks_per_node=1", "train.global_batch=32",
                    "fault.max_restarts=2", "fault.hang_timeout_s=60", "fault.startup_timeout_s=300"])


class Job:
    """A run directory, a fake Slurm holding `nodes` and the Supervisor of job 42."""

    def __init__(self, tmp_path: Path, base: Config, scripts: list[Script], *, nodes=("node1", "node2"),
                 spare_nodes: int = 0, **fault) -> None:
        cfg = copy.deepcopy(base)
        cfg.run.root = str(tmp_path)
        cfg.spare_nodes = spare_nodes
        for key, value in fault.items():
            setattr(cfg.fault, key, value)
        self.plan = make_plan(cfg)
        self.run = RunDir(Path(self.plan.run_dir))
        self.run.path.mkdir(parents=True)
        self.run.plan_json.write_text(self.plan.to_json())
        self.clock = FakeClock()
        self.fake = FakeSlurm(self.clock, list(nodes), scripts)
        self.environ = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_RESTART_COUNT": "0"}
        self.sup = Supervisor(self.run, self.plan, "42", slurm=Slurm(self.fake, self.clock), environ=self.environ)
        self.fake.signal_handler = self.sup.note_signal

    def events(self, name: str | None = None) -> list[dict]:
        return [e for e in self.run.events_list() if name is None or e["event"] == name]

    def srun_flag(self, start: int, flag: str) -> str:
        return next(a.split("=", 1)[1] for a in self.fake.srun_calls[start] if a.startswith(f"--{flag}="))

    def summary(self) -> dict:
        return json.loads(self.run.summary.read_text())

    def requeue_calls(self) -> list[list[str]]:
        return [c for c in self.fake.calls if c[:2] == ["scontrol", "requeue"]]


def test_finished_start_ends_the_driver_with_no_requeue(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=0, steps=10)])
    assert job.sup.drive() == 0
    assert len(job.fake.steps) == 1 and job.requeue_calls() == []
    (started,) = job.events("started")
    assert started["nodes"] == ["node1", "node2"] and started["world_size"] == 2 and started["restart"] == 0
    assert job.srun_flag(0, "nodelist") == "node1,node2" and job.srun_flag(0, "cpus-per-task") == "1"
    env = job.fake.steps[0].env
    assert env["DTK_MASTER_ADDR"] == "node1" and env["DTK_RESTART"] == "0"
    assert env["DTK_PLAN"] == str(job.run.log_dir(0) / "plan.json")


def test_workers_stopped_on_a_signal_are_requeued(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=EXIT_STOPPED, steps=30, checkpoint=True, preempted=True)])
    assert job.sup.drive() == EXIT_STOPPED
    assert job.requeue_calls() == [["scontrol", "requeue", "42"]] and job.fake.state == "PENDING"
    (requeued,) = job.events("requeued")
    assert requeued["step"] == 30 and requeued["reason"] == "stopped on a signal" and requeued["exclude"] == []
    assert requeued["detected_at"] == job.events("preempted")[0]["time"]


def test_the_allocation_after_a_requeue_resumes_and_measures_recovery_from_the_stop(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=EXIT_STOPPED, steps=30, checkpoint=True, preempted=True)])
    assert job.sup.drive() == EXIT_STOPPED
    (requeued,) = job.events("requeued")
    fake = FakeSlurm(job.clock, ["node1", "node2"], [Script(exit=0, steps=10)])
    environ = dict(job.environ, SLURM_RESTART_COUNT="1")
    assert Supervisor(job.run, job.plan, "42", slurm=Slurm(fake, job.clock), environ=environ).drive() == 0
    assert [(e["restart"], e["slurm_restart_count"]) for e in job.events("started")] == [(0, 0), (1, 1)]
    assert fake.steps[0].env["DTK_RECOVERY_FROM"] == str(requeued["detected_at"])


@pytest.mark.parametrize("code", [1, 143])
def test_a_preempted_event_counts_whatever_srun_says(tmp_path, base_config, code):
    # Preemption signals srun too: it may exit "terminated" although the workers saved.
    job = Job(tmp_path, base_config, [Script(exit=code, steps=30, checkpoint=True, preempted=True)])
    assert job.sup.drive() == EXIT_STOPPED and len(job.requeue_calls()) == 1


def test_a_signal_to_the_driver_is_a_stop_and_requeues(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=143, steps=20, checkpoint=True, driver_signal=signal.SIGTERM)])
    assert job.sup.drive() == EXIT_STOPPED
    assert job.sup.signalled == signal.SIGTERM and len(job.requeue_calls()) == 1 and not job.events("relaunched")


def test_scancel_of_the_job_is_a_stop_the_workers_save_and_nothing_is_requeued(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=None, steps=25)])
    job.fake.scripts[0].at_s = {10.0: job.fake.scancel}
    assert job.sup.drive() == 0
    assert job.requeue_calls() == [] and not job.events("requeued")
    (stopped,) = job.events("stopped")
    assert stopped["by"] == "scancel 42" and stopped["checkpoint"] == 25 and stopped["job_id"] == "42"
    assert job.summary()["status"] == "stopped" and job.summary()["checkpoint"] == 25


@pytest.mark.parametrize("slurm_view", [
    {"state": "RUNNING"},  # a preemption still in its GraceTime
    {"state": "COMPLETING", "restarts": 1},  # a preemption after Slurm requeued the job
    {"state": "COMPLETING", "reason": "TimeLimit"},  # the time limit itself
])
def test_a_sigterm_slurm_does_not_show_as_a_cancel_still_requeues(tmp_path, base_config, slurm_view):
    job = Job(tmp_path, base_config, [Script(exit=143, steps=20, checkpoint=True, driver_signal=signal.SIGTERM)])
    for key, value in slurm_view.items():
        setattr(job.fake, key, value)
    job.fake.requeue_refusal = None if slurm_view["state"] == "RUNNING" else "Job is no longer running"
    job.fake.state_after_refusal = "PENDING"
    assert job.sup.drive() == EXIT_STOPPED
    assert not job.events("stopped") and len(job.events("requeued")) == 1


@pytest.mark.parametrize("now", [False, True])
def test_a_stop_request_signals_the_workers_and_ends_the_job_without_requeue(tmp_path, base_config, now):
    job = Job(tmp_path, base_config, [Script(exit=None, steps=25)])
    ask = lambda: job.run.stop_request.write_text(json.dumps({"by": "alice", "now": now}))  # noqa: E731
    job.fake.scripts[0].at_s = {10.0: ask}
    assert job.sup.drive() == 0
    signal_sent = [c[1] for c in job.fake.calls if c[0] == "scancel"]
    assert signal_sent == ["--signal=KILL" if now else "--signal=TERM"]
    (stopped,) = job.events("stopped")
    assert stopped["by"] == "dtk.stop by alice" + (" --now" if now else "")
    assert stopped["checkpoint"] == (None if now else 25)  # --now: killed, nothing saved
    assert job.requeue_calls() == [] and not job.run.stop_request.exists()


def test_a_stop_request_before_a_start_starts_nothing(tmp_path, base_config):
    job = Job(tmp_path, base_config, [])
    job.run.stop_request.write_text(json.dumps({"by": "bob", "now": False}))
    assert job.sup.drive() == 0
    assert job.fake.steps == [] and job.events("stopped")[0]["by"] == "dtk.stop by bob"


def test_a_stop_without_a_new_checkpoint_fails_instead_of_requeueing_forever(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=EXIT_STOPPED, steps=0, preempted=True)])
    job.run.checkpoint_dir(20).mkdir(parents=True)
    (job.run.checkpoint_dir(20) / "manifest.json").write_text("{}")  # from an earlier allocation
    with pytest.raises(DriverFailed, match="stopped again at step 20 without completing a checkpoint"):
        job.sup.drive()
    assert job.requeue_calls() == [] and job.summary()["status"] == "failed"
    assert "not requeued" in job.events("failed")[0]["error"]


def test_a_lost_node_is_excluded_and_the_spare_takes_its_place(tmp_path, base_config):
    scripts = [Script(exit=137, steps=25, checkpoint=True, lose=("node2",)), Script(exit=0, steps=10)]
    job = Job(tmp_path, base_config, scripts, nodes=("node1", "node2", "node3"), spare_nodes=1)
    assert job.sup.drive() == 0
    assert job.srun_flag(0, "nodelist") == "node1,node2" and job.srun_flag(1, "nodelist") == "node1,node3"
    assert job.srun_flag(1, "nodes") == "2" and job.requeue_calls() == []
    (failed,) = job.events("node_failed")
    assert failed["nodes"] == ["node2"] and failed["resume_from"] == 25
    excluded = json.loads((job.run.path / "excluded_nodes.json").read_text())
    assert [(e["node"], e["job_id"]) for e in excluded] == [("node2", "42")]
    assert job.sup.relaunches == 0 and not job.events("relaunched")  # a lost node costs no relaunch
    assert job.fake.steps[1].env["DTK_RECOVERY_FROM"] != ""


def test_without_a_spare_the_run_shrinks_to_the_nodes_left_with_the_same_global_batch(tmp_path, base_config):
    scripts = [Script(exit=137, steps=25, checkpoint=True, lose=("node2",)), Script(exit=0, steps=10)]
    job = Job(tmp_path, base_config, scripts)
    assert job.sup.drive() == 0
    assert (job.srun_flag(1, "nodes"), job.srun_flag(1, "ntasks"), job.srun_flag(1, "nodelist")) == ("1", "1", "node1")
    shrunk = json.loads((job.run.log_dir(1) / "plan.json").read_text())
    assert shrunk["world_size"] == 1 and shrunk["global_batch"] == job.plan.global_batch
    assert shrunk["grad_accum"] == 2 * job.plan.grad_accum
    assert job.events("started")[1]["world_size"] == 1


def test_too_few_nodes_left_requeues_with_the_lost_node_excluded(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=137, steps=25, checkpoint=True, lose=("node2",))], shrink=False)
    assert job.sup.drive() == EXIT_STOPPED
    assert len(job.fake.steps) == 1 and job.fake.excluded == ["node2"] and job.fake.state == "PENDING"
    (requeued,) = job.events("requeued")
    assert requeued["reason"] == "1 usable node(s) left, 2 needed" and requeued["exclude"] == ["node2"]
    assert requeued["detected_at"] == job.clock.start + 5  # when the step's end was seen, in the driver's clock


def test_the_exclusion_is_set_while_the_job_is_held_and_checked_before_the_release(tmp_path, base_config):
    # Slurm refuses ExcNodeList while the job runs (the fake too): requeue held, update,
    # read it back, release.
    job = Job(tmp_path, base_config, [Script(exit=137, steps=25, checkpoint=True, lose=("node2",))], shrink=False)
    assert job.sup.drive() == EXIT_STOPPED
    telling = [c[:2] + c[3:] for c in job.fake.calls if c[0] == "scontrol" and c[1] in ("requeue", "requeuehold",
                                                                                         "update", "release")]
    assert telling == [["scontrol", "requeuehold"], ["scontrol", "update", "ExcNodeList=node2"],
                       ["scontrol", "release"]]
    assert job.fake.excluded == ["node2"] and not job.fake.held and job.fake.state == "PENDING"


def test_a_readmitted_node_is_cleared_from_the_job_at_the_next_requeue(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=EXIT_STOPPED, steps=30, checkpoint=True, preempted=True)])
    job.fake.excluded = ["node3"]  # set at an earlier requeue
    add_exclusions(job.run, ["node3"], job_id="41", reason="node(s) node3 left the job")
    readmit(job.run, "node3", by="root", reason="repaired")
    assert job.sup.drive() == EXIT_STOPPED
    assert job.fake.excluded == [] and not job.fake.held and job.events("requeued")[0]["exclude"] == []


def test_the_requeue_keeps_the_nodes_of_cluster_exclude_from_out_too(tmp_path, base_config):
    listed = tmp_path / "bad_nodes.txt"
    listed.write_text("node9  # no InfiniBand\n")
    cfg = copy.deepcopy(base_config)
    cfg.cluster.exclude_from = str(listed)
    job = Job(tmp_path, cfg, [Script(exit=137, steps=25, checkpoint=True, lose=("node2",))], shrink=False)
    assert job.sup.drive() == EXIT_STOPPED
    assert job.fake.excluded == ["node2", "node9"] and job.events("requeued")[0]["exclude"] == ["node2", "node9"]


def test_an_unchanged_exclusion_is_a_plain_requeue(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=EXIT_STOPPED, steps=30, checkpoint=True, preempted=True)])
    add_exclusions(job.run, ["node3"], job_id="41", reason="node(s) node3 left the job")
    job.fake.excluded = ["node3"]
    assert job.sup.drive() == EXIT_STOPPED
    assert job.requeue_calls() == [["scontrol", "requeue", "42"]] and job.fake.excluded == ["node3"]


def test_a_refused_exclusion_is_reported_and_the_job_still_requeued(tmp_path, base_config, capsys):
    job = Job(tmp_path, base_config, [Script(exit=137, steps=25, checkpoint=True, lose=("node2",))], shrink=False)
    job.fake.update_refusal = "slurm_update error: Invalid node name specified"
    assert job.sup.drive() == EXIT_STOPPED and job.fake.state == "PENDING"
    assert "driver: Slurm refused to exclude node2: slurm_update error: Invalid node name" in capsys.readouterr().err


def shrunk_job(tmp_path, base_config, second: Script) -> Job:
    """node2 fails, the job goes on on node1; node2 is back in service 30 s later."""
    job = Job(tmp_path, base_config, [Script(exit=137, steps=25, checkpoint=True, lose=("node2",)), second])
    job.fake.node_states = {"node1": "allocated", "node2": "down*", "node3": "allocated"}
    t_back = job.clock.time() + 30

    def node2_returns() -> None:
        if job.clock.time() >= t_back and job.fake.node_states["node2"] == "down*":
            job.fake.node_states["node2"] = "idle"

    job.clock.on_sleep.append(node2_returns)
    return job


def test_a_shrunk_job_grows_back_once_the_node_returns_and_passes_its_health_job(tmp_path, base_config):
    job = shrunk_job(tmp_path, base_config, Script(exit=None, steps=10, first_step=True))
    assert job.sup.drive() == EXIT_STOPPED
    (health,) = job.fake.health_jobs
    assert "--nodelist=node2" in health.argv and "SLURM_JOB_ID" not in health.env
    (readmitted,) = job.events("node_readmitted")
    assert readmitted["nodes"] == ["node2"] and readmitted["by"] == "driver"
    (entry,) = json.loads((job.run.path / "excluded_nodes.json").read_text())
    assert entry["readmitted"]["reason"] == "back in service (idle) and its health job passed"
    (returned,) = job.events("node_returned")
    assert returned["nodes"] == ["node2"] and (returned["world_size"], returned["to_world_size"]) == (1, 2)
    assert job.fake.steps[1].stop_signals == ["USR2"]  # the workers stop at a step boundary and save
    (requeued,) = job.events("requeued")
    assert requeued["reason"] == "grow back to 2 nodes" and requeued["exclude"] == [] and requeued["step"] == 36
    # The next allocation has both nodes again: the run goes on at its full size.
    fake = FakeSlurm(job.clock, ["node1", "node2"], [Script(exit=0, steps=5)])
    environ = dict(job.environ, SLURM_RESTART_COUNT="1")
    assert Supervisor(job.run, job.plan, "42", slurm=Slurm(fake, job.clock), environ=environ).drive() == 0
    (grown,) = job.events("grown")
    assert (grown["from_world_size"], grown["world_size"], grown["nodes"]) == (1, 2, ["node1", "node2"])


def test_a_node_that_fails_its_health_job_stays_excluded_and_the_job_stays_shrunk(tmp_path, base_config):
    job = shrunk_job(tmp_path, base_config, Script(exit=0, after_s=100, steps=10, first_step=True))
    job.fake.health_passes = False
    assert job.sup.drive() == 0
    assert job.fake.health_jobs and job.events("health_failed")[0]["nodes"] == ["node2"]
    assert not job.events("node_returned") and not job.events("node_readmitted")
    assert read_exclusions(job.run) == ["node2"]


def test_the_driver_stops_the_workers_when_the_time_left_falls_to_save_step_and_margin(tmp_path, base_config):
    # A measured save of 50 s: the sbatch signal's 60 s floor would leave too little;
    # the driver stops the workers at 50 + 30 s before the end itself.
    job = Job(tmp_path, base_config, [Script(exit=None, steps=10)])
    job.run.event("checkpoint_saved", step=0, seconds=50.0)
    job.fake.end_time = job.clock.time() + 200
    assert job.sup.drive() == EXIT_STOPPED
    (near,) = job.events("time_limit_near")
    assert near["need_s"] == 80.0 and 79.0 <= near["left_s"] <= 80.0
    assert job.fake.steps[0].stop_signals == ["USR2"]
    assert job.events("requeued")[0]["reason"] == f"time limit in {near['left_s']:.0f} s, a stop needs 80 s"


def test_before_any_save_the_stop_is_sized_from_the_planned_checkpoint_and_the_storage(tmp_path, base_config):
    from dtk.driver.timeleft import needed_s, planned_checkpoint_bytes, save_estimate_s

    job = Job(tmp_path, base_config, [])
    assert planned_checkpoint_bytes(job.plan) > 0
    estimate = save_estimate_s(job.plan, job.run.path)
    assert estimate is not None and estimate > 0 and not list(job.run.path.glob(".throughput_probe*"))
    assert needed_s(job.run, estimate_s=estimate) == estimate + 30
    assert needed_s(job.run, estimate_s=None) is None  # then the sbatch signal alone


def test_a_crash_is_relaunched_from_the_last_checkpoint(tmp_path, base_config):
    scripts = [Script(exit=1, steps=25, checkpoint=True, log=CRASH_LOG), Script(exit=0, steps=10)]
    job = Job(tmp_path, base_config, scripts)
    assert job.sup.drive() == 0
    (relaunched,) = job.events("relaunched")
    assert relaunched["cause"] == "crashed" and relaunched["detail"] == "rank 0: RuntimeError: boom"
    assert relaunched["resume_from"] == 25 and relaunched["attempt"] == 1
    assert job.srun_flag(1, "nodelist") == "node1,node2" and job.fake.steps[1].env["DTK_RESTART"] == "1"


def test_a_crash_names_the_rank_srun_saw_die_first_not_the_peer_that_reported_an_error(tmp_path, base_config):
    # Rank 1 was killed; rank 0 then failed in its collective ("Connection reset by peer"),
    # and srun ended it. The cause is rank 1, its host and its own log's last line.
    report = ("srun: error: node2: task 1: Killed\n"
              "srun: error: node1: task 0: Exited with exit code 1")
    logs = {0: "step 30\nRuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection reset by peer",
            1: "step 30\nsaving nothing, about to die"}
    scripts = [Script(exit=1, steps=25, checkpoint=True, logs=logs, srun_report=report), Script(exit=0, steps=10)]
    job = Job(tmp_path, base_config, scripts)
    assert job.sup.drive() == 0
    (relaunched,) = job.events("relaunched")
    assert relaunched["detail"] == ("rank 1 on node2 died first (Killed); its log ends: saving nothing, about to die;"
                                    " the other ranks' errors are consequences")
    assert (job.run.path / "logs" / "start_00" / "srun.log").read_text().startswith("srun: error: node2: task 1")


def test_crashes_beyond_max_restarts_fail_the_job_with_the_last_cause(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=1, log=CRASH_LOG) for _ in range(3)])
    with pytest.raises(DriverFailed) as failed:
        job.sup.drive()
    assert str(failed.value) == ("crashed 3 times in job 42 (fault.max_restarts=2); last cause: rank 0: RuntimeError: boom")
    assert len(job.fake.steps) == 3 and len(job.events("relaunched")) == 2 and job.requeue_calls() == []
    assert job.summary()["status"] == "failed" and job.summary()["error"] == str(failed.value)
    assert job.summary()["restarts"] == 2


USER_BUG = {"type": "RuntimeError", "message": "view size is not compatible with input tensor's size and stride",
            "file": "/home/alice/proj/loss.py", "line": 12}


def test_the_same_error_in_user_code_at_two_starts_fails_the_job_without_a_third(tmp_path, base_config):
    def died(**record):  # what dtk/worker/failure.py writes for rank 0 of the current start
        return lambda: job.run.worker_error(job.run.starts() - 1, 0).write_text(json.dumps({**USER_BUG, **record}))

    scripts = [Script(exit=1, steps=5, log=CRASH_LOG, at_s={1.0: died()}),
               Script(exit=1, log=CRASH_LOG, at_s={1.0: died()}), Script(exit=0)]
    job = Job(tmp_path, base_config, scripts, max_restarts=5)
    with pytest.raises(DriverFailed) as failed:
        job.sup.drive()
    assert str(failed.value) == ("the same exception in user code ended two starts in a row without progress;"
                                 " not relaunched (job 42): RuntimeError: view size is not compatible with input"
                                 " tensor's size and stride at /home/alice/proj/loss.py:12 (step 5)")
    assert len(job.fake.steps) == 2 and len(job.events("relaunched")) == 1 and job.requeue_calls() == []
    (event,) = job.events("user_code_error")
    assert event["file"] == USER_BUG["file"] and event["line"] == 12 and event["step"] == 5
    assert job.summary()["status"] == "failed" and job.summary()["error"] == str(failed.value)


def test_a_user_code_error_that_moves_to_another_line_is_relaunched(tmp_path, base_config):
    def died(**record):
        return lambda: job.run.worker_error(job.run.starts() - 1, 0).write_text(json.dumps({**USER_BUG, **record}))

    scripts = [Script(exit=1, steps=5, log=CRASH_LOG, at_s={1.0: died()}),
               Script(exit=1, log=CRASH_LOG, at_s={1.0: died(line=40)}), Script(exit=0, steps=5)]
    job = Job(tmp_path, base_config, scripts, max_restarts=5)
    assert job.sup.drive() == 0
    assert len(job.events("relaunched")) == 2 and job.events("user_code_error") == []


def test_a_silent_step_is_torn_down_after_the_hang_timeout_and_relaunched(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=None, steps=5, stop_beating_s=10), Script(exit=0, steps=10)])
    assert job.sup.drive() == 0
    (hang,) = job.events("hang_detected")
    assert 60 < hang["silent_s"] <= 61 and hang["limit_s"] == 60
    assert ["scancel", "--signal=KILL", "42.0"] in job.fake.calls and job.fake.steps[0].cancelled
    assert job.events("relaunched")[0]["cause"] == "hung"
    assert 70 <= job.clock.slept < 80  # found 60 s after the last beat, not at the time limit


def test_a_start_that_never_beats_is_a_hang_after_the_startup_timeout(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=None, beat=False, unkillable=True), Script(exit=0)])
    assert job.sup.drive() == 0
    (hang,) = job.events("hang_detected")
    assert hang["limit_s"] == 300 and 300 < hang["silent_s"] <= 301
    assert job.fake.steps[0].killed  # srun ignored the cancel: the driver killed srun itself


def test_a_hung_step_is_killed_through_srun_when_slurm_cannot_cancel_it(tmp_path, base_config, capsys):
    job = Job(tmp_path, base_config, [Script(exit=None, beat=False), Script(exit=0)])
    job.fake.fail_next["squeue"] = 10**6  # the step list cannot be had
    assert job.sup.drive() == 0
    assert job.fake.steps[0].killed and not job.fake.steps[0].cancelled
    assert "killing srun" in capsys.readouterr().err and job.events("relaunched")[0]["cause"] == "hung"


def test_hangs_count_against_max_restarts_like_crashes(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=None, beat=False) for _ in range(2)], max_restarts=1)
    with pytest.raises(DriverFailed, match=r"hung 2 times in job 42 \(fault.max_restarts=1\); last cause: no heartbeat"):
        job.sup.drive()


@pytest.mark.parametrize("code", [EXIT_CONFIG, 137])
def test_a_configuration_error_fails_the_job_at_the_first_start(tmp_path, base_config, code):
    # srun may report another rank's fate (137: killed by --kill-on-bad-exit); the line decides.
    job = Job(tmp_path, base_config, [Script(exit=code, log=CONFIG_LOG), Script(exit=0)])
    with pytest.raises(DriverFailed) as failed:
        job.sup.drive()
    assert str(failed.value) == f"configuration error in job 42, not relaunched: rank 0: {CONFIG_LOG}"
    assert len(job.fake.steps) == 1 and not job.events("relaunched") and job.requeue_calls() == []
    assert job.summary()["error"] == str(failed.value)


def test_the_batch_script_entry_point_ends_a_failed_job_with_one_error_line(tmp_path, base_config, capsys):
    job = Job(tmp_path, base_config, [Script(exit=EXIT_CONFIG, log=CONFIG_LOG)])
    with pytest.raises(DriverFailed):
        drive(str(job.run.path), slurm=Slurm(job.fake, job.clock), environ=job.environ)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: configuration error in job 42, not relaunched: rank 0: {CONFIG_LOG}"]


def test_exit_code_2_without_a_line_is_still_a_configuration_error(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=EXIT_CONFIG)])
    with pytest.raises(DriverFailed, match="a worker exited with code 2"):
        job.sup.drive()


def test_a_requeue_slurm_already_made_is_not_a_failure(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=EXIT_STOPPED, steps=30, checkpoint=True, preempted=True)])
    job.fake.requeue_refusal = "scontrol_requeue error: Job is pending execution"
    job.fake.state_after_refusal = "PENDING"  # preemption with PreemptMode=REQUEUE got there first
    assert job.sup.drive() == EXIT_STOPPED and not job.events("failed")


def test_a_requeue_slurm_refuses_fails_the_job(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=EXIT_STOPPED, steps=30, checkpoint=True, preempted=True)])
    job.fake.requeue_refusal = "scontrol_requeue error: Requested operation is presently disabled"
    with pytest.raises(DriverFailed, match="scontrol requeue 42 failed: .*presently disabled"):
        job.sup.drive()
    assert job.clock.slept <= 5 + 10.5  # the step, then 10 s watching the job before giving up


def test_transient_query_failures_are_retried(tmp_path, base_config):
    scripts = [Script(exit=137, steps=25, checkpoint=True, lose=("node2",)), Script(exit=0)]
    job = Job(tmp_path, base_config, scripts, nodes=("node1", "node2", "node3"), spare_nodes=1)
    job.fake.fail_next["scontrol"] = 3  # before the first start: 3 failures, then an answer
    assert job.sup.drive() == 0
    assert job.fake.fail_next["scontrol"] == 0 and job.clock.slept >= 1 + 2 + 4
    assert job.srun_flag(1, "nodelist") == "node1,node3"  # the node loss was still seen


def test_a_transient_requeue_failure_is_retried(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=EXIT_STOPPED, steps=30, checkpoint=True, preempted=True)])
    job.fake.fail_next["scontrol requeue"] = 2
    assert job.sup.drive() == EXIT_STOPPED and len(job.requeue_calls()) == 3 and job.fake.state == "PENDING"


def test_slurm_silent_beyond_the_bound_fails_the_driver_with_an_error_line(tmp_path, base_config, capsys):
    job = Job(tmp_path, base_config, [])
    job.fake.fail_next["scontrol"] = 10**6
    with pytest.raises(SlurmUnavailable, match="scontrol show job 42 -o` failed .* over 300 s; last: .*Socket timed out"):
        drive(str(job.run.path), slurm=Slurm(job.fake, job.clock), environ=job.environ)
    assert RETRY_S - 15 <= job.clock.slept <= RETRY_S
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: Slurm did not answer the driver of job 42:")
    assert job.summary()["status"] == "failed" and "Socket timed out" in job.summary()["error"]
    assert signal.getsignal(signal.SIGUSR2) is not job.sup.note_signal  # handlers restored


def test_the_decision_table_in_one_place():
    """decide() alone, row by row (the Supervisor tests above run each row end to end)."""
    def row(kind: Kind, *, relaunches=0, progressed=True) -> Action:
        return decide(Outcome(kind, cause="c"), job_id="1", relaunches=relaunches, max_restarts=2,
                      progressed=progressed, step=5).action

    assert row(Kind.FINISHED) is Action.FINISH
    assert row(Kind.STOP_ASKED, relaunches=99, progressed=False) is Action.STOP
    assert row(Kind.CONFIG_ERROR, relaunches=0) is Action.FAIL
    assert row(Kind.STOPPED) is Action.REQUEUE and row(Kind.STOPPED, progressed=False) is Action.FAIL
    assert row(Kind.NODE_FAILED, relaunches=99) is Action.EXCLUDE
    for kind in (Kind.CRASHED, Kind.HUNG):
        assert [row(kind, relaunches=r) for r in range(4)] == [Action.RELAUNCH] * 2 + [Action.FAIL] * 2
    # The same exception from the same user frame at the same step as the start before, with
    # no checkpoint between: USER_CODE_ERROR, whatever budget is left; anything else relaunches.
    bug = UserFault("RuntimeError", "view size", "/p/loss.py", 12, step=5)

    def user(fault, previous, *, kind=Kind.CRASHED, progressed=False) -> Action:
        return decide(Outcome(kind, cause="c"), job_id="1", relaunches=0, max_restarts=2, progressed=progressed,
                      step=5, fault=fault, previous=previous).action

    assert user(bug, bug) is Action.USER_CODE_ERROR
    assert user(bug, dataclasses.replace(bug, rank=1)) is Action.USER_CODE_ERROR  # whichever rank recorded it
    assert user(bug, None) is user(None, bug) is user(bug, bug, progressed=True) is Action.RELAUNCH
    for change in ({"type": "ValueError"}, {"message": "other"}, {"file": "/p/x.py"}, {"line": 13}, {"step": 6}):
        assert user(bug, dataclasses.replace(bug, **change)) is Action.RELAUNCH, change
    assert user(bug, bug, kind=Kind.HUNG) is Action.RELAUNCH
    # classify's order: configuration error > stop > lost node > crash.
    every = Facts(code=1, workers_stopped=True, signalled=True, lost=("n2",), error_line="rank 0: error: x")
    assert classify(every, detected_at=1).kind is Kind.CONFIG_ERROR
    assert classify(Facts(code=1, signalled=True, lost=("n2",)), detected_at=1).kind is Kind.STOPPED
    assert classify(Facts(code=137, lost=("n2",)), detected_at=1).kind is Kind.NODE_FAILED
    assert classify(Facts(code=137, crash_cause="why"), detected_at=1).cause == "why"
    assert classify(Facts(code=0, lost=("n2",)), detected_at=1).kind is Kind.FINISHED
    # an asked-for stop wins over everything but a finish
    asked = Facts(code=137, workers_stopped=True, lost=("n2",), error_line="rank 0: error: x", stop_asked="scancel 1")
    assert classify(asked, detected_at=1).kind is Kind.STOP_ASKED
    assert classify(Facts(code=0, stop_asked="scancel 1"), detected_at=1).kind is Kind.FINISHED


def test_a_stop_request_left_from_before_the_submission_stops_nothing(tmp_path, base_config):
    """A request whose dtk.stop gave up (or whose driver died) before the run was submitted
    again is stale: the job trains, and the request is gone."""
    job = Job(tmp_path, base_config, [Script(exit=0, steps=10)])
    job.run.stop_request.write_text(json.dumps({"by": "bob", "now": False, "time": 1000.0}))
    job.run.event("submitted", cluster="slurm", job_id="42")
    assert job.sup.drive() == 0
    assert len(job.fake.steps) == 1 and not job.events("stopped") and not job.run.stop_request.exists()


def test_a_stop_withdrawn_after_the_workers_were_told_still_ends_as_a_stop(tmp_path, base_config):
    """dtk.stop removes its request when it stops waiting; the driver remembers who asked."""
    job = Job(tmp_path, base_config, [Script(exit=None, steps=25)])
    ask = lambda: job.run.stop_request.write_text(json.dumps({"by": "alice", "now": False}))  # noqa: E731
    job.fake.scripts[0].at_s = {10.0: ask}
    signal_steps = job.sup.slurm.signal_steps

    def signal_then_withdraw(job_id, signal_name):  # dtk.stop gives up right after the driver told the workers
        signal_steps(job_id, signal_name)
        job.run.stop_request.unlink()

    job.sup.slurm.signal_steps = signal_then_withdraw
    assert job.sup.drive() == 0
    assert job.events("stopped")[0]["by"] == "dtk.stop by alice" and job.requeue_calls() == []


def test_a_run_that_finishes_or_fails_leaves_no_stop_request(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=0, steps=10)])
    late = lambda: job.run.stop_request.write_text(json.dumps({"by": "carol", "now": False}))  # noqa: E731
    job.fake.scripts[0].at_s = {4.9: late}  # asked as the last step ends: the driver polls next after the exit
    assert job.sup.drive() == 0 and not job.events("stopped")
    assert not job.run.stop_request.exists()
    job.run.stop_request.write_text(json.dumps({"by": "carol", "now": False}))
    record_failure(job.run, error="boom", restarts=0)  # what both drivers call when a run fails
    assert not job.run.stop_request.exists()
