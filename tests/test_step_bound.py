"""fault.max_steps: the worker steps (srun) one Slurm job starts are bounded, over all its
allocations, against the fake Slurm in fake time (sites cap a job's steps, MaxStepCount)."""

from __future__ import annotations

import pytest
from test_supervisor import CRASH_LOG, Job

from conftest import run_main
from dtk.config.compose import compose
from dtk.driver.supervisor import DriverFailed, Supervisor
from dtk.launch.slurmctl import Slurm
from dtk.worker.codes import EXIT_STOPPED
from fake_slurm import FakeSlurm, Script


@pytest.fixture(scope="module")
def base_config():
    return compose(["cluster=lab", "nodes=2", "tasks_per_node=1", "train.global_batch=32",
                    "fault.hang_timeout_s=60", "fault.startup_timeout_s=300"])


def test_crashes_stop_at_fault_max_steps_before_max_restarts(tmp_path, base_config):
    job = Job(tmp_path, base_config, [Script(exit=1, log=CRASH_LOG) for _ in range(10)], max_restarts=9,
              max_steps=4)
    with pytest.raises(DriverFailed) as failed:
        job.sup.drive()
    assert len(job.fake.steps) == 4 and len(job.events("started")) == 4
    assert str(failed.value).startswith("job 42 started 4 worker steps (fault.max_steps=4); not starting another")
    assert job.summary()["status"] == "failed" and job.summary()["error"] == str(failed.value)


def test_the_bound_counts_the_steps_of_the_job_across_its_requeues(tmp_path, base_config):
    # allocation 1: a crash, then a stop that saved (requeued); allocation 2 of the same job
    # id may start only what is left of fault.max_steps=4, however its starts end
    job = Job(tmp_path, base_config, [Script(exit=1, log=CRASH_LOG),
                                      Script(exit=EXIT_STOPPED, steps=30, checkpoint=True, preempted=True)],
              max_restarts=9, max_steps=4)
    assert job.sup.drive() == EXIT_STOPPED
    fake = FakeSlurm(job.clock, ["node1", "node2"], [Script(exit=1, log=CRASH_LOG) for _ in range(10)])
    again = Supervisor(job.run, job.plan, "42", slurm=Slurm(fake, job.clock),
                       environ=dict(job.environ, SLURM_RESTART_COUNT="1"))
    with pytest.raises(DriverFailed, match=r"started 4 worker steps \(fault.max_steps=4\).* checkpoint step 30"):
        again.drive()
    assert len(job.fake.steps) + len(fake.steps) == 4
    # a new job of the same run (the same command again) starts afresh
    fresh = FakeSlurm(job.clock, ["node1", "node2"], [Script(exit=0, steps=40)])
    assert Supervisor(job.run, job.plan, "43", slurm=Slurm(fresh, job.clock),
                      environ=dict(job.environ, SLURM_JOB_ID="43")).drive() == 0
    assert len(fresh.steps) == 1


@pytest.mark.parametrize("value", ["0", "-1"])
def test_fault_max_steps_below_one_is_one_error_line(tmp_path, value):
    proc = run_main("dtk.plan", f"fault.max_steps={value}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: fault.max_steps={value}: expected a positive integer"
