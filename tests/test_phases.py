"""Phase timer and straggler arithmetic, in one process (real runs: test_phases_runs.py)."""

from __future__ import annotations

import time

import pytest
import torch

from dtk.train.phases import LAPS, PhaseTimer, StepTimes, attribute_overlap
from dtk.train.straggler import combine, flag, idle_share

CPU = torch.device("cpu")


def test_laps_add_up_to_the_step_and_accumulate_over_micro_batches():
    timer = PhaseTimer(device=CPU)
    timer.begin(0)
    time.sleep(0.02)
    timer.lap("data")
    for _ in range(2):
        time.sleep(0.01)
        timer.lap("forward")
        time.sleep(0.015)
        timer.lap("backward")
    timer.lap("optimizer")
    timer.end()
    (s,) = timer.collect()
    assert s.step == 0
    assert s.laps["data"] >= 0.02 and s.laps["forward"] >= 0.02 and s.laps["backward"] >= 0.03
    assert sum(s.laps.values()) == pytest.approx(s.total_s, rel=1e-9)
    assert timer.collect() == []  # read once


def test_the_wait_after_the_last_gradient_is_sync():
    model = torch.nn.Linear(4, 4)
    timer = PhaseTimer(device=CPU)
    timer.watch_gradients(list(model.parameters()))
    timer.begin(1)
    loss = model(torch.randn(2, 4)).sum()
    timer.lap("forward")
    loss.backward()
    time.sleep(0.03)  # what a data-parallel reduction would wait after the gradients are ready
    timer.lap("backward")
    timer.end()
    (s,) = timer.collect()
    assert s.laps["sync"] >= 0.03 > s.laps["backward"]
    timer.close()


def test_disabled_timer_records_nothing():
    timer = PhaseTimer(device=CPU, enabled=False)
    timer.begin(0)
    timer.lap("data")
    timer.end()
    assert timer.collect() == []


def _step(step, total, **laps):
    full = dict.fromkeys(LAPS, 0.0)
    full.update(laps)
    return StepTimes(step, total, full)


def test_background_write_slowdown_goes_to_checkpoint():
    steps = [_step(i, 1.0, forward=0.4, backward=0.5, optimizer=0.1) for i in range(4)]
    slow = _step(4, 1.3, forward=0.52, backward=0.65, optimizer=0.13)
    slow.overlapped = True
    attribute_overlap(steps + [slow])
    assert slow.laps["checkpoint"] == pytest.approx(0.3)
    assert sum(slow.laps.values()) == pytest.approx(1.3)
    assert steps[0].laps["checkpoint"] == 0.0


def test_the_slow_rank_is_flagged_and_the_others_show_straggler_time():
    # Rank 1 spends 50 ms more on its forward; rank 0 waits for it at the reduction.
    fast = _step(7, 0.080, data=0.001, forward=0.010, backward=0.010, sync=0.055, optimizer=0.004)
    slow = _step(7, 0.080, data=0.001, forward=0.060, backward=0.010, sync=0.005, optimizer=0.004)
    interval = combine([7], [[fast.vector()], [slow.vector()]], factor=1.5, me=0)
    ph = interval.phases[7]
    assert ph["straggler"] == pytest.approx(0.050) and ph["comm"] == pytest.approx(0.005)
    assert sum(ph.values()) == pytest.approx(0.080)
    assert idle_share(ph, 0.080) == pytest.approx((0.001 + 0.005 + 0.050) / 0.080)
    assert [s["rank"] for s in interval.stragglers] == [1]
    assert interval.ranks["busy_s"] == pytest.approx([0.030, 0.080])
    # Every rank's phases: where the slow rank's time went, and what the others waited.
    assert interval.ranks["forward_s"] == pytest.approx([0.010, 0.060])
    assert interval.ranks["straggler_s"] == pytest.approx([0.050, 0.0])
    assert interval.ranks["comm_s"] == pytest.approx([0.005, 0.005])
    mine = combine([7], [[fast.vector()], [slow.vector()]], factor=1.5, me=1).phases[7]
    assert mine["straggler"] == 0.0


def test_flag_uses_the_factor_over_the_low_median():
    assert flag([1.0, 1.05, 0.98, 1.02], factor=1.2) == []
    flagged = flag([1.0, 1.0, 1.0, 1.5], factor=1.2)
    assert [f["rank"] for f in flagged] == [3] and flagged[0]["ratio"] == 1.5
    assert flag([1.0], factor=1.2) == []


def test_epoch_time_is_the_seconds_of_an_epoch_seen_from_its_start():
    from dtk.train.metrics import EpochClock

    clock = EpochClock(samples_per_epoch=100, global_batch=25)  # 4 steps per epoch
    got = [clock.add(step, 0.5) for step in range(1, 9)]
    assert got == [None, None, None, 2.0, None, None, None, 2.0]
    # 40 samples per step: step 3 crosses the boundary at 100; 3 steps took 120 samples.
    uneven = EpochClock(samples_per_epoch=100, global_batch=40)
    assert [uneven.add(step, 1.0) for step in (1, 2, 3)] == [None, None, pytest.approx(3.0 * 100 / 120)]
    resumed = EpochClock(samples_per_epoch=100, global_batch=25)  # a restart at step 2: epoch 0 not seen whole
    assert [resumed.add(step, 0.5) for step in range(3, 9)] == [None, None, None, None, None, 2.0]
    assert EpochClock(samples_per_epoch=None, global_batch=25).add(1, 0.5) is None


@pytest.mark.parametrize("profile", [True, False])
def test_records_are_written_at_every_checkpointed_step(profile):
    # A worker killed after a save must not lose the records of the steps before it: its
    # restart resumes from that save and never computes them again.
    from dtk.train.profile import StepProfiler

    class Metrics:
        def __init__(self):
            self.writes = []

        def write(self, interval):
            self.writes.append(step)

    metrics = Metrics()
    saved = {"step": None}
    profiler = StepProfiler(device=torch.device("cpu"), enabled=profile, straggler_factor=1.5, run=None, rank=0,
                            log_every=100, total_steps=50, metrics=metrics, saving=lambda: False,
                            checkpointed=lambda: saved["step"])
    for step in range(1, 51):
        if step in (7, 20):
            saved["step"] = step
        profiler.after_step(step)
    assert metrics.writes == [7, 20, 50]
