"""Host sampling into system.jsonl and TensorBoard event files with the metrics' scalars."""

from __future__ import annotations

import json
import time

import pytest

from dtk.common.rundir import read_jsonl
from dtk.train.system import Nvml, SystemSampler
from dtk.train.tensorboard import TENSORBOARD_DIR, TensorBoardLog, scalars


class FakeNvml(Nvml):
    """Two GPUs' readings, as NVML would give them: the only fake here, for a machine without GPUs."""

    def __init__(self) -> None:
        self.available = True

    def read(self):
        return [{"index": 0, "util_percent": 97, "mem_used_gib": 40.0, "power_w": 650.0},
                {"index": 1, "util_percent": 95, "mem_used_gib": 39.5, "power_w": 640.0}]


def test_sampler_writes_host_records_off_the_training_thread(tmp_path):
    path = tmp_path / "system.jsonl"
    sampler = SystemSampler(path, interval_s=0.05, rank=0).start()
    deadline = time.monotonic() + 10
    while len(list(read_jsonl(path))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # the training thread's place: the sampler's records come from its own thread
    sampler.stop()
    records = list(read_jsonl(path))
    assert len(records) >= 3
    r = records[-1]
    for key in ("time", "host", "rank", "cpu_percent", "mem_used_gib", "mem_percent", "net_recv_mb_s", "net_sent_mb_s"):
        assert key in r, key
    assert 0 <= r["cpu_percent"] <= 100 * 64 and r["mem_used_gib"] > 0
    assert "gpus" not in r or Nvml().available  # no NVML here: no GPU readings invented
    count = len(records)
    time.sleep(0.2)
    assert len(list(read_jsonl(path))) == count  # stopped means stopped


def test_gpu_readings_go_into_each_record_when_nvml_is_there(tmp_path):
    sampler = SystemSampler(tmp_path / "s.jsonl", interval_s=1.0, rank=0, nvml=FakeNvml())
    record = sampler.sample()
    assert [g["util_percent"] for g in record["gpus"]] == [97, 95]


def test_report_reads_system_records(tmp_path):
    from dtk.report.numbers import system_load

    samples = [{"host": "n1", "cpu_percent": 50.0, "mem_used_gib": 3.0, "gpus": [{"util_percent": 90, "power_w": 600}]},
               {"host": "n2", "cpu_percent": 70.0, "mem_used_gib": 5.0, "gpus": [{"util_percent": 80, "power_w": 500}]}]
    load = system_load(samples)
    assert load["cpu_percent_mean"] == 60.0 and load["mem_used_gib_max"] == 5.0
    assert load["gpu_util_percent_mean"] == 85.0 and load["gpu_power_w_mean"] == 550.0
    assert load["hosts"] == ["n1", "n2"]


def test_tensorboard_files_hold_the_same_scalars_as_metrics(tmp_path):
    pytest.importorskip("tensorboard", reason="the optional tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [{"step": s, "time": 1000.0 + s, "loss": 5.0 - s, "lr": 1e-3, "step_time_s": 0.1, "world_size": 2,
                "phases": {"data": 0.01, "forward": 0.03}, "idle_share": 0.1, "batch_hash": "ab"} for s in (1, 2, 3)]
    log = TensorBoardLog(tmp_path)
    for r in records:
        log.add(r)
    log.close()
    acc = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == set(scalars(records[0])) == {"loss", "lr", "step_time_s", "phases/data", "phases/forward", "idle_share"}
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert acc.Scalars("phases/data")[0].wall_time == 1001.0
    json.dumps(scalars(records[0]))  # plain numbers only
