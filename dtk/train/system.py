"""Host and GPU load, sampled in a background thread into system.jsonl.

One sampler per node (the worker with local rank 0), so a record describes a whole host:
CPU utilisation and load, memory, disk and network throughput (psutil), and per GPU the
utilisation, memory and power that NVML reports (through `pynvml`, from the optional
nvidia-ml-py package; without it, or without a driver, records carry no `gpus`).

Sampling runs off the training thread: psutil and NVML calls take tens of microseconds to
milliseconds and would otherwise land in a step's time. Rates (MB/s) are taken between
consecutive samples, so the first sample only sets the counters.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from dtk.common.rundir import append_jsonl

_MB = 1e6
_GIB = 2**30


class Nvml:
    """GPU readings through NVML; `available` is False without pynvml or a driver."""

    def __init__(self) -> None:
        self.available = False
        self._handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = True
        except Exception:  # ImportError, NVMLError (no driver, no device): GPU metrics are optional
            self._handles = []

    def read(self) -> list[dict[str, Any]]:
        out = []
        for index, h in enumerate(self._handles):
            gpu: dict[str, Any] = {"index": index}
            for key, read in (
                ("util_percent", lambda h: self._nv.nvmlDeviceGetUtilizationRates(h).gpu),
                ("mem_used_gib", lambda h: round(self._nv.nvmlDeviceGetMemoryInfo(h).used / _GIB, 3)),
                ("power_w", lambda h: round(self._nv.nvmlDeviceGetPowerUsage(h) / 1000.0, 1)),
            ):
                try:
                    gpu[key] = read(h)
                except Exception:  # a reading this device does not support stays absent
                    pass
            out.append(gpu)
        return out


class SystemSampler:
    """Appends one record every `interval_s` seconds to `path` until stopped."""

    def __init__(self, path: Path, *, interval_s: float, rank: int, nvml: Nvml | None = None) -> None:
        self.path = path
        self.interval_s = interval_s
        self.rank = rank
        self.host = socket.gethostname()
        self.nvml = nvml if nvml is not None else Nvml()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[float, Any, Any] | None = None
        psutil.cpu_percent(interval=None)  # the first call only sets psutil's reference point

    def _counters(self):
        try:
            disk = psutil.disk_io_counters()
        except (RuntimeError, OSError):  # no disks visible (some containers)
            disk = None
        return time.monotonic(), disk, psutil.net_io_counters()

    def sample(self) -> dict[str, Any]:
        """One record now. Rates cover the time since the previous call."""
        now, disk, net = self._counters()
        mem = psutil.virtual_memory()
        record: dict[str, Any] = {
            "time": round(time.time(), 3),
            "host": self.host,
            "rank": self.rank,
            "cpu_percent": psutil.cpu_percent(interval=None),
            "load1": round(psutil.getloadavg()[0], 2),
            "mem_used_gib": round((mem.total - mem.available) / _GIB, 3),
            "mem_percent": mem.percent,
        }
        if self._last is not None:
            t0, disk0, net0 = self._last
            dt = max(now - t0, 1e-6)
            if disk is not None and disk0 is not None:
                record["disk_read_mb_s"] = round((disk.read_bytes - disk0.read_bytes) / dt / _MB, 3)
                record["disk_write_mb_s"] = round((disk.write_bytes - disk0.write_bytes) / dt / _MB, 3)
            record["net_recv_mb_s"] = round((net.bytes_recv - net0.bytes_recv) / dt / _MB, 3)
            record["net_sent_mb_s"] = round((net.bytes_sent - net0.bytes_sent) / dt / _MB, 3)
        self._last = (now, disk, net)
        if self.nvml.available:
            record["gpus"] = self.nvml.read()
        return record

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                append_jsonl(self.path, self.sample())
            except OSError:  # a full or vanished disk must not end training; the next sample retries
                pass

    def start(self) -> SystemSampler:
        self.sample()  # sets the counters the first written record's rates start from
        self._thread = threading.Thread(target=self._loop, name="dtk-system", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (and wait for a sample being written), then write one last record:
        the time since the last sample is measured too, and a run shorter than the
        interval still has one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
            try:
                append_jsonl(self.path, self.sample())
            except OSError:
                pass
