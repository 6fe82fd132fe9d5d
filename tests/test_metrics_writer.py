"""metrics.jsonl is written by a thread of its own: the training thread hands an interval's
records over and goes on; `close` (and `step`, for a loop without the profiler) waits for
them, and a failed write is raised, not lost."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from dtk.common.rundir import read_jsonl
from dtk.train import metrics as metrics_module
from dtk.train.metrics import MetricsLog


def result(loss: float) -> SimpleNamespace:
    return SimpleNamespace(loss=loss, lr=1e-3, grad_norm=1.0, step_time_s=0.1, data_wait_s=0.0, batch_hash="x")


def log(path) -> MetricsLog:
    return MetricsLog(path, world_size=1, restart=0, global_batch=4, tokens_per_step=32, total_steps=10, log_every=5,
                      samples_per_epoch=None, flops_per_token=None, peak_tflops=None)


def test_the_training_thread_hands_the_records_over_and_goes_on(tmp_path, monkeypatch):
    writers: list[str] = []
    append = metrics_module.append_jsonl

    def slow_append(path, record):
        writers.append(threading.current_thread().name)
        time.sleep(0.05)
        append(path, record)

    monkeypatch.setattr(metrics_module, "append_jsonl", slow_append)
    metrics = log(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        metrics.after_step(step, result(2.0 / step))
    metrics.write(None)
    assert len(list(read_jsonl(tmp_path / "metrics.jsonl"))) < 5  # not all written yet: the thread is at it
    metrics.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert writers and all(name.startswith("dtk-metrics") for name in writers)


def test_a_failed_write_is_raised_at_the_next_write_or_close(tmp_path):
    metrics = log(tmp_path / "missing" / "metrics.jsonl")  # no such folder: the append fails
    metrics.after_step(1, result(1.0))
    metrics.write(None)
    with pytest.raises(FileNotFoundError):
        metrics.close()
