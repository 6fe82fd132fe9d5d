"""The loop's policies: the order Trainer.fit runs them in, the agreed stop, the `resumed`
event, and the one table of what a driver tells a worker. One process, a tiny real model."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from dtk.common.rundir import RunDir
from dtk.data.loader import StepBatches
from dtk.data.synthetic import SyntheticTokens
from dtk.driver.local import worker_env
from dtk.mesh.mesh import ParallelMesh
from dtk.models.transformer import build
from dtk.train.loss import TokenCrossEntropy
from dtk.train.policies import AgreedStop, Heartbeat, ResumedEvent, StepPolicies, StopRequested
from dtk.train.task import LmTask
from dtk.train.trainer import Trainer
from dtk.worker.env import DRIVER_ENV, driver_env, read_env


class Recorder:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def after_step(self, step, result) -> None:
        self.log.append((self.name, step))


def tiny_trainer(timer=None) -> Trainer:
    torch.manual_seed(0)
    model = build(vocab_size=32, dim=16, num_layers=1, num_heads=2, seq_len=8)
    data = SyntheticTokens(num_samples=64, seq_len=8, vocab_size=32, seed=0, branching=2)
    batches = StepBatches(data, seed=0, global_batch=4, micro_batch=2, dp_rank=0, dp_size=1, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return Trainer(model=model, optimizer=optimizer, scheduler=scheduler, batches=batches, task=LmTask(TokenCrossEntropy()),
                   grad_clip=1.0, mesh=ParallelMesh.single(), timer=timer)


def test_fit_runs_the_policies_after_every_step_in_their_order():
    log: list = []
    names = ["metrics", "heartbeat", "resumed", "evaluation", "checkpoint", "stop", "profile"]
    policies = StepPolicies(**{name: Recorder(name, log) for name in names})
    trainer = tiny_trainer()
    result = trainer.fit(start_step=3, total_steps=5, policies=policies)
    trainer.batches.close()
    order = ["metrics", "heartbeat", "resumed", "evaluation", "checkpoint", "heartbeat", "stop", "profile"]
    assert log == [(name, 4) for name in order] + [(name, 5) for name in order]
    assert result is not None and result.loss > 0


class FakeCheckpoints:
    def __init__(self, *, fails: bool = False) -> None:
        self.calls: list = []
        self.fails = fails
        self.verified_step: int | None = 5

    def save(self, step: int) -> None:
        self.calls.append(("save", step))
        if not self.fails:
            self.verified_step = step

    def close(self) -> None:
        self.calls.append(("close",))


def test_an_agreed_stop_saves_commits_and_stops(tmp_path):
    run = RunDir(tmp_path)
    checkpoints = FakeCheckpoints()
    stop = AgreedStop(agreed=lambda s: (int(signal.SIGUSR2), s), checkpoints=checkpoints, total_steps=10, run=run,
                      restart=2, budget_s=1.0)
    with pytest.raises(StopRequested) as exc:
        stop.after_step(7)
    assert (exc.value.step, exc.value.signum) == (7, signal.SIGUSR2)
    assert checkpoints.calls == [("save", 7), ("close",)]  # committed before the stop
    (event,) = [e for e in run.events_list() if e["event"] == "preempted"]
    assert (event["step"], event["signal"], event["restart"]) == (7, "SIGUSR2", 2)
    assert (event["saved"], event["checkpoint_step"]) == (True, 7)


def test_a_stop_whose_save_failed_says_so(tmp_path):
    """The driver requeues only when a checkpoint was committed since the start; the event
    and the worker's line say the stop's own save failed, and which checkpoint is newest."""
    run = RunDir(tmp_path)
    stop = AgreedStop(agreed=lambda s: (int(signal.SIGTERM), s), checkpoints=FakeCheckpoints(fails=True),
                      total_steps=10, run=run, restart=0, budget_s=1.0)
    with pytest.raises(StopRequested) as exc:
        stop.after_step(7)
    assert not exc.value.saved
    assert str(exc.value) == ("stopped at step 7 on SIGTERM; its checkpoint could NOT be saved; the newest"
                              " verified checkpoint is step 5")
    (event,) = [e for e in run.events_list() if e["event"] == "preempted"]
    assert (event["saved"], event["checkpoint_step"]) == (False, 5)


def test_no_stop_without_a_signal_or_at_the_last_step(tmp_path):
    asked: list = []
    checkpoints = FakeCheckpoints()

    def agreed(seconds: float) -> tuple[int, float]:
        asked.append(1)
        return int(signal.SIGTERM), seconds

    AgreedStop(agreed=lambda s: (0, s), checkpoints=checkpoints, total_steps=10, run=None, restart=0,
               budget_s=1.0).after_step(3)
    AgreedStop(agreed=agreed, checkpoints=checkpoints, total_steps=10, run=None, restart=0,
               budget_s=1.0).after_step(10)
    assert checkpoints.calls == [] and asked == []  # the last step's save is due anyway; no collective


def test_the_stop_vote_comes_as_often_as_the_budget_asks():
    """After the first step the ranks vote as many steps apart as fit in budget_s at the
    agreed (largest) step time; an agreed stop during an evaluation is acted on at once."""
    now = [0.0]
    votes: list = []

    def agreed(seconds: float) -> tuple[int, float]:
        votes.append((step, round(seconds, 6)))
        return 0, max(seconds, 0.25)  # another rank measured 0.25 s per step

    stop = AgreedStop(agreed=agreed, checkpoints=FakeCheckpoints(), total_steps=100, run=None, restart=0,
                      budget_s=1.0, clock=lambda: now[0])
    for step in range(1, 20):
        now[0] += 0.1  # this rank: 0.1 s per step
        stop.after_step(step)
    # step 1: nothing measured here yet, 0.25 s agreed -> every 4 steps
    assert votes == [(1, 0.0), (5, 0.1), (9, 0.1), (13, 0.1), (17, 0.1)]
    assert stop.every == 4
    assert not stop.poll()
    signalled = AgreedStop(agreed=lambda s: (int(signal.SIGTERM), s), checkpoints=FakeCheckpoints(), total_steps=100,
                           run=None, restart=0, budget_s=1.0)
    signalled.next_vote = 50
    assert signalled.poll() and signalled.due(21)


def test_resumed_is_written_once_after_the_first_step_of_a_restart(tmp_path):
    run = RunDir(tmp_path)
    resumed = ResumedEvent(run, start_step=20, restart=1, world_size=4, recovery_from=1.0, job_id="77")
    for step in (21, 22):
        resumed.after_step(step)
    (event,) = [e for e in run.events_list() if e["event"] == "resumed"]
    assert (event["step"], event["restart"], event["world_size"], event["job_id"]) == (20, 1, 4, "77")
    assert event["recovery_s"] > 0
    fresh = ResumedEvent(run, start_step=0, restart=0, world_size=4, recovery_from=0.0, job_id=None)
    fresh.after_step(1)
    assert len([e for e in run.events_list() if e["event"] == "resumed"]) == 1


def test_both_drivers_write_the_one_table_and_the_worker_reads_it(tmp_path):
    said = driver_env(master_addr="node1", master_port=1234, restart=3, plan=tmp_path / "plan.json",
                      recovery_from=12.5)
    assert set(said) == set(DRIVER_ENV.values())
    local = worker_env(rank=1, world=2, local_world=2, port=4321, restart=0, plan=tmp_path / "plan.json")
    assert set(DRIVER_ENV.values()) <= set(local)  # the local driver sets what the Slurm one sets
    env = read_env({**said, "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "99",
                    "SLURM_CPUS_PER_TASK": "4"})
    assert (env.master_addr, env.master_port, env.restart, env.plan, env.recovery_from) == (
        "node1", 1234, 3, str(tmp_path / "plan.json"), 12.5)
    assert (env.source, env.rank, env.world_size, env.job_id, env.cpus_per_task) == ("slurm", 5, 8, "99", 4)
    first = read_env(local)
    assert (first.source, first.rank, first.restart, first.recovery_from) == ("dtk", 1, 0, 0.0)


def test_once_the_heartbeat_thread_runs_a_step_touches_no_file(tmp_path):
    """Rank 0's step boundary does no file I/O for liveness: the thread beats for it."""
    path = tmp_path / "heartbeat"
    heartbeat = Heartbeat(path, interval_s=3600.0)  # the thread never gets to beat here
    heartbeat.after_step(0)  # before the thread: this beat creates the file
    heartbeat.start()  # beats once at once: the driver sees the start is alive
    assert os.stat(path).st_mtime_ns != 1
    os.utime(path, ns=(1, 1))
    try:
        for step in range(1, 6):
            heartbeat.after_step(step)
        assert os.stat(path).st_mtime_ns == 1 and heartbeat.progress == 6
    finally:
        heartbeat.close()


def test_the_heartbeat_thread_beats_while_the_training_thread_progresses_or_is_busy(tmp_path):
    """A real thread and a real file: beats follow progress (ticks) and declared long
    operations (a save, the first step); a training thread that neither ticks nor is busy
    (blocked in a collective) gets no beat, so the driver's hang timeout sees it."""
    path = tmp_path / "heartbeat"
    heartbeat = Heartbeat(path, interval_s=0.02)
    heartbeat.after_step(0)

    def beats_within(seconds: float) -> bool:
        before = os.stat(path).st_mtime_ns
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if os.stat(path).st_mtime_ns != before:
                return True
            time.sleep(0.01)
        return False

    heartbeat.start()
    try:
        assert beats_within(2.0)  # the first step (compilation, warm-up) counts as busy
        heartbeat.after_step(1)
        time.sleep(0.1)  # the thread saw that tick
        assert not beats_within(0.3)  # no progress and nothing declared: silence
        with heartbeat.busy():  # a synchronous save: no tick for its whole length
            assert beats_within(2.0) and beats_within(2.0)
        time.sleep(0.1)
        assert not beats_within(0.3)
        heartbeat.tick()  # a validation batch
        assert beats_within(2.0)
    finally:
        heartbeat.close()
    assert heartbeat._thread is None


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_heartbeat_beats_past_the_timeout_only_as_long_as_the_measured_gaps_ask():
    """Ticks slower than fault.hang_timeout_s (a micro-batch of 10 s against 3 s) raise the
    limit to twice the longest gap: the thread beats until 2 x 10 - 3 = 17 s after the
    last tick, and the driver's 3 s come on top. Ticks faster than the timeout raise
    nothing, and a declared operation or the start's own warm-up is no gap."""
    clock = _Clock()
    heartbeat = Heartbeat(None, hang_timeout_s=3.0, clock=clock)
    heartbeat.start()
    clock.now += 500.0  # a checkpoint load and compilation, before the first tick
    heartbeat.tick()
    assert heartbeat.longest_gap_s == 0.0
    for _ in range(5):  # fast micro-batches
        clock.now += 1.0
        heartbeat.tick()
    heartbeat.after_step(1)
    seen = heartbeat.progress
    assert heartbeat.allowance_s() == 0.0
    clock.now += 0.5
    assert not heartbeat.due(seen)  # silence: the driver's hang_timeout_s counts from here
    with heartbeat.busy():
        clock.now += 600.0  # a synchronous save
        assert heartbeat.due(seen)
    heartbeat.tick()
    assert heartbeat.longest_gap_s == 1.0  # the save was no gap
    clock.now += 10.0  # a slow micro-batch
    heartbeat.tick()
    seen = heartbeat.progress
    assert heartbeat.allowance_s() == 17.0
    clock.now += 16.9
    assert heartbeat.due(seen)
    clock.now += 0.2
    assert not heartbeat.due(seen)
