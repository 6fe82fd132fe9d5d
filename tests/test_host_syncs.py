"""Host-device syncs of the training loop: at most one per `train.log_every` interval.

On a GPU every read of a device value by the host (`.item()`, `float()`, `.tolist()`, a
tensor in an `if`) waits for all the work queued before it, and the GPU idles while the
host then queues the next step. On the CPU nothing waits, but the reads are the same
calls, so this test counts them: every such call made by dtk's own code while the loop
runs (torch's internals are left out: the optimizer reads its step counters, which live
on the host). Reads that wait for nothing (`dtk.mesh.host.host_only`: the stop vote on its
gloo group, the metrics values read right after the profiler's read of the same interval
waited for the device) are counted apart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_policies import FakeCheckpoints, Recorder, tiny_trainer

import dtk
from dtk.common.rundir import RunDir
from dtk.mesh.host import in_host_only
from dtk.train.metrics import MetricsLog
from dtk.train.policies import AgreedStop, Heartbeat, StepPolicies
from dtk.train.profile import StepProfiler
from dtk.worker.signals import StopFlag

DTK = str(Path(dtk.__file__).parent)
READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")
STEPS, LOG_EVERY = 20, 5


class SyncCounter:
    """Wraps the Tensor methods that read a value into the host; counts calls from dtk."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        self.host_reads = 0
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def read(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(DTK):
                if in_host_only():
                    self.host_reads += 1
                else:
                    self.calls.append(f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return original(tensor, *args, **kwargs)

        return read


def run_loop(tmp_path: Path, *, log_every: int, profile: bool) -> tuple[SyncCounter, list[dict]]:
    """Train STEPS steps with the real metrics, heartbeat, stop and profile policies (the
    profiler on, as train.profile's default, or off); the reads dtk made while `fit` ran,
    and metrics.jsonl."""
    tmp_path.mkdir()
    run = RunDir(tmp_path)
    metrics = MetricsLog(run.metrics, world_size=1, restart=0, global_batch=4, tokens_per_step=32, total_steps=STEPS,
                         log_every=log_every, samples_per_epoch=None, flops_per_token=None, peak_tflops=None)
    profiler = StepProfiler(device=torch.device("cpu"), enabled=profile, straggler_factor=1.5, run=run, rank=0,
                            log_every=log_every, total_steps=STEPS, metrics=metrics, saving=None)
    trainer = tiny_trainer(timer=profiler.timer)
    flag = StopFlag()
    stop = AgreedStop(agreed=lambda s: flag.vote(None, s), checkpoints=FakeCheckpoints(), total_steps=STEPS, run=run,
                      restart=0, budget_s=1.0)
    log: list = []
    policies = StepPolicies(metrics=metrics, heartbeat=Heartbeat(tmp_path / "heartbeat"),
                            resumed=Recorder("resumed", log), evaluation=Recorder("evaluation", log),
                            checkpoint=Recorder("checkpoint", log), stop=stop, profile=profiler)
    with pytest.MonkeyPatch.context() as patch:
        counter = SyncCounter(patch)
        trainer.fit(start_step=0, total_steps=STEPS, policies=policies)
    metrics.close()
    profiler.close()
    trainer.batches.close()
    records = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    return counter, records


@pytest.mark.slow  # trains the loop 4 times (32 steps in all): seconds
@pytest.mark.parametrize("profile", [True, False], ids=["profiled", "unprofiled"])
def test_the_loop_syncs_at_most_once_per_logging_interval(tmp_path, profile):
    counter, records = run_loop(tmp_path / "a", log_every=LOG_EVERY, profile=profile)
    assert len(counter.calls) <= STEPS // LOG_EVERY, "\n".join(counter.calls)
    # Every step still has its record, with the values one read per step gives.
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    per_step, each = run_loop(tmp_path / "b", log_every=1, profile=profile)
    assert len(per_step.calls) == STEPS  # the counter sees the interval's read: one per interval of one step
    for r, e in zip(records, each, strict=True):
        assert (r["loss"], r["grad_norm"], r["batch_hash"]) == (e["loss"], e["grad_norm"], e["batch_hash"])
        assert isinstance(r["loss"], float) and r["loss"] > 0
