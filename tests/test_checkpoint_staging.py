"""An async save copies the state to host memory in the background (DCP's DefaultStager,
pinned memory on a GPU) while training goes on; what changes the state in place (the
optimizer step, a forward that updates saved buffers) waits for the copy, so a checkpoint
holds the state of its step. The copy is slowed down here so that training reaches those
points while it still runs."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from test_checkpoint import events, make_parts, manager, params, resume_fresh, train_step
from torch.distributed.checkpoint.staging import DefaultStager

from dtk.checkpoint.manager import CheckpointManager
from dtk.common.rundir import RunDir
from dtk.train.policies import Heartbeat

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
COPY_DELAY_S = 0.3


@pytest.fixture
def slow_copy(monkeypatch):
    stage = DefaultStager._stage

    def slow(self, state_dict, **kwargs):
        time.sleep(COPY_DELAY_S)
        return stage(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", slow)


def save_then_train(folder, *, model=None, optimizer=None, scheduler=None):
    run = RunDir(folder)
    run.path.mkdir()
    if model is None:
        model, optimizer, scheduler = make_parts()
    ckpt = manager(run, model, optimizer, scheduler, asynchronous=True)
    train_step(model, optimizer, scheduler)
    at_save = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    ckpt.save(1)
    returned_s = time.perf_counter() - t0
    train_step(model, optimizer, scheduler)  # reaches the optimizer step while the copy runs
    later = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckpt.close()
    return run, at_save, later, returned_s


def test_the_save_returns_before_the_copy_and_the_optimizer_step_waits_for_it(tmp_path, slow_copy):
    run, at_save, later, returned_s = save_then_train(tmp_path / "run")
    assert returned_s < COPY_DELAY_S  # the copy runs beside training, not inside save()
    assert not all(torch.equal(at_save[k], later[k]) for k in at_save)
    step, fresh = resume_fresh(run)
    assert step == 1
    assert all(torch.equal(a, at_save[k]) for a, k in zip(params(fresh), at_save, strict=True))
    (saved,) = events(run, "checkpoint_saved")
    assert saved["asynchronous"] and saved["staging_seconds"] >= COPY_DELAY_S


def test_without_the_wait_the_checkpoint_would_hold_the_next_step(tmp_path, slow_copy, monkeypatch):
    """What the test above guards against: with the hooks off, the copy reads parameters the
    next optimizer step already changed."""
    monkeypatch.setattr(CheckpointManager, "_guard_state", lambda self, parts: None)
    run, at_save, later, _ = save_then_train(tmp_path / "run")
    _, fresh = resume_fresh(run)
    assert all(torch.equal(a, later[k]) for a, k in zip(params(fresh), later, strict=True))
    assert not all(torch.equal(a, at_save[k]) for a, k in zip(params(fresh), at_save, strict=True))


def test_a_forward_that_updates_saved_buffers_waits_for_the_copy_too(tmp_path, slow_copy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    run, at_save, later, _ = save_then_train(tmp_path / "run", model=model, optimizer=optimizer, scheduler=scheduler)
    assert not torch.equal(at_save["1.running_mean"], later["1.running_mean"])

    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt = manager(run, fresh, fresh_opt, torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0))
    assert ckpt.resume() == 1
    ckpt.close()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_save[k]), k


def test_the_optimizer_steps_wait_for_the_copy_is_heartbeat_busy_time(tmp_path, slow_copy):
    """The wait of the next optimizer step for an async save's copy (the first one also
    pins its host buffers: tens of seconds for tens of GB) runs inside the heartbeat's busy
    window, so the heartbeat thread beats through it: a real Heartbeat, whose busy count is
    read from inside the copy's wait."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    model, optimizer, scheduler = make_parts()
    heartbeat = Heartbeat(None)
    ckpt = manager(run, model, optimizer, scheduler, asynchronous=True)
    seen: list[int] = []

    @contextlib.contextmanager
    def busy():
        with heartbeat.busy():
            seen.append(heartbeat._busy)
            yield
    ckpt.busy = busy
    train_step(model, optimizer, scheduler)
    ckpt.save(1)
    seen.clear()  # the save's own blocking part is busy too; what follows is the step's wait
    waiting = ckpt._saver._staging
    train_step(model, optimizer, scheduler)  # the optimizer step waits for the copy
    assert waiting is not None and waiting.done()
    assert seen == [1]  # the wait ran inside exactly one busy window
    ckpt.close()


def test_the_stager_reuses_its_buffers_and_copies_the_current_values_at_every_save():
    """dtk.checkpoint.staging: the second and later saves copy into the buffers of the first
    (the GIL-free copy), and each holds the state at its own save, bit for bit."""
    from torch.distributed.checkpoint.staging import StagingOptions

    from dtk.checkpoint import staging as module
    from dtk.checkpoint.staging import stager

    state = {"w": torch.randn(64, 32), "b": torch.arange(10, dtype=torch.int64), "h": torch.randn(8).half()}
    staging = stager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                                    use_non_blocking_copy=False))
    assert isinstance(staging._state_dict_stager, module._Stager)  # dtk's copy, not DCP's
    try:
        first = staging.stage(state).result()
        assert all(torch.equal(first[k], state[k]) for k in state)
        pointers = {k: first[k].data_ptr() for k in state}
        for v in state.values():
            v.add_(3)
        second = staging.stage(state).result()
        assert {k: second[k].data_ptr() for k in state} == pointers  # the same host buffers
        assert all(torch.equal(second[k], state[k]) for k in state)
        assert all(second[k].data_ptr() != state[k].data_ptr() for k in state)  # copies, not the live tensors
    finally:
        staging.close()
