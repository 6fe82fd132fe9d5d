"""Per-step metrics: one JSON line per step in metrics.jsonl (global rank 0 only).

A step's record is kept until its logging interval ends (`train.log_every` steps, the last
step, a checkpointed step, an agreed stop): then the profiler has read the interval's phase
times, and the records are written with them, together (dtk.train.profile). A worker killed
mid-interval loses only the records of steps after its newest checkpoint, which its restart
computes again anyway.

The step's loss and gradient norm stay tensors on the device until then (a GPU runs ahead
of the host only while the host reads nothing of it): `write` reads the interval's values
in one transfer. After the profiler's read of the same interval (which waited for the
device already) that transfer waits for nothing; without the profiler it is the
interval's one host-device synchronisation.

The records are written to the file (and TensorBoard, and handed to the trackers'
threads, and the progress line printed) by a
thread of their own: the training thread computes them and goes on, and a slow shared file
system costs it nothing. A write that failed is raised at the next write or at `close`.

Each record: loss, learning rate, gradient norm, step time, throughput (samples/s,
tokens/s), achieved TFLOP/s per device and MFU where the model's FLOPs and the device's
peak are known, the step's `phases` and `idle_share` when profiled, `epoch_time_s` at a
step that completes an epoch, and on an interval's last record the per-rank times (`ranks`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dtk.common.rundir import append_jsonl
from dtk.mesh.host import host_only
from dtk.train.flops import achieved
from dtk.train.straggler import Interval, idle_share


def read_values(results: list[Any], *, synced: bool) -> None:
    """Make the device tensors `loss` and `grad_norm` of `results` floats, in one transfer.
    `synced`: the device has finished the steps already (the profiler waited for it)."""
    tensors = [r for r in results if isinstance(r.loss, torch.Tensor)]
    if not tensors:
        return
    stacked = torch.stack([torch.stack([r.loss.detach().float(), r.grad_norm.detach().float().to(r.loss.device)])
                           for r in tensors])
    with host_only() if synced else contextlib.nullcontext():
        values = stacked.tolist()
    for r, (loss, grad_norm) in zip(tensors, values, strict=True):
        r.loss, r.grad_norm = loss, grad_norm


class EpochClock:
    """Seconds per epoch from the step times: at a step that crosses an epoch boundary, the
    time of the steps since the previous boundary, scaled to one epoch's samples. Only for
    epochs this process saw from their start (a resume mid-epoch skips the first)."""

    def __init__(self, *, samples_per_epoch: int | None, global_batch: int) -> None:
        self.samples_per_epoch = samples_per_epoch
        self.global_batch = global_batch
        self._seconds = 0.0
        self._samples = 0
        self._whole: bool | None = None

    def add(self, step: int, seconds: float) -> float | None:
        n, b = self.samples_per_epoch, self.global_batch
        if not n:
            return None
        start, end = (step - 1) * b, step * b
        if self._whole is None:
            self._whole = start % n == 0
        self._seconds += seconds
        self._samples += b
        if end // n == start // n and end % n:
            return None
        out = self._seconds * n / self._samples if self._whole else None
        self._seconds, self._samples, self._whole = 0.0, 0, True
        return out


class MetricsLog:
    """The metrics policy: keeps each step's record (global rank 0; `path` None on the
    others: nothing), written by `write()` at the end of its interval."""

    def __init__(
        self,
        path: Path | None,
        *,
        world_size: int,
        restart: int,
        global_batch: int,
        tokens_per_step: int,
        total_steps: int,
        log_every: int,
        samples_per_epoch: int | None,
        flops_per_token: float | None,
        peak_tflops: float | None,
        tensorboard: Any = None,
        trackers: tuple[Any, ...] = (),
    ) -> None:
        self.path = path
        self.world_size = world_size
        self.restart = restart
        self.global_batch = global_batch
        self.tokens_per_step = tokens_per_step
        self.total_steps = total_steps
        self.log_every = log_every
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.tensorboard = tensorboard  # TensorBoardLog or None
        self.trackers = trackers  # dtk.train.tracker.TrackerSink each: handed the records, never waited for
        self.epochs = EpochClock(samples_per_epoch=samples_per_epoch, global_batch=global_batch)
        self._pending: list[tuple[int, float, Any]] = []
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtk-metrics") if path else None
        self._written: Future | None = None  # the last write handed to the thread

    def after_step(self, step: int, result: Any) -> None:
        if self.path is not None:
            self._pending.append((step, time.time(), result))

    def step(self, step: int, result: Any) -> None:
        """Write one step's record now (no phases): for a loop that runs without the profiler."""
        self.after_step(step, result)
        self.write(None)
        self.flush()

    def record(self, step: int, at: float, result: Any, interval: Interval | None) -> dict[str, Any]:
        profiled = interval is not None and step in interval.phases
        step_time = interval.step_time_s[step] if interval is not None and profiled else result.step_time_s
        per_s = 1.0 / max(step_time, 1e-9)
        record: dict[str, Any] = {
            "step": step,
            "time": round(at, 3),
            "loss": float(result.loss),
            "lr": result.lr,
            "grad_norm": round(float(result.grad_norm), 6),
            "world_size": self.world_size,
            "restart": self.restart,
            "step_time_s": round(step_time, 6),
            "data_wait_s": round(result.data_wait_s, 6),
            "samples_per_s": round(self.global_batch * per_s, 2),
            "tokens_per_s": round(self.tokens_per_step * per_s, 1),
        }
        if self.flops_per_token and self.tokens_per_step:
            record.update(achieved(tokens_per_s=self.tokens_per_step * per_s, flops_per_token=self.flops_per_token,
                                   num_devices=self.world_size, peak_tflops=self.peak_tflops))
        if interval is not None and profiled:
            phases = interval.phases[step]
            record["phases"] = {p: round(v, 6) for p, v in phases.items()}
            record["idle_share"] = round(idle_share(phases, step_time), 4)
        epoch_s = self.epochs.add(step, step_time)
        if epoch_s is not None:
            record["epoch_time_s"] = round(epoch_s, 3)
        record["batch_hash"] = result.batch_hash
        if getattr(result, "skipped", ""):  # no update made (dtk.train.divergence): why
            record["skipped"] = result.skipped
        return record

    def write(self, interval: Interval | None) -> None:
        """The records kept since the last write, with the interval's phases where it has them."""
        pending, self._pending = self._pending, []
        if self.path is None or not pending:
            return
        read_values([result for _, _, result in pending], synced=interval is not None)
        records = [self.record(step, at, result, interval) for step, at, result in pending]
        if interval is not None:
            records[-1]["ranks"] = {k: [round(x, 6) if isinstance(x, float) else x for x in v]
                                    for k, v in interval.ranks.items()}
        self.flush()  # the previous write: done long ago, unless the file system is that slow
        assert self._writer is not None
        self._written = self._writer.submit(self._emit, records)

    def _emit(self, records: list[dict[str, Any]]) -> None:
        """The writer thread: the records, TensorBoard, the progress line."""
        assert self.path is not None
        for record in records:
            append_jsonl(self.path, record)
            if self.tensorboard is not None:
                self.tensorboard.add(record)
        if self.tensorboard is not None:
            self.tensorboard.flush()
        for sink in self.trackers:
            sink.add(records)
        last = records[-1]
        step = last["step"]
        if step % self.log_every == 0 or step == self.total_steps:
            idle = f", idle {100 * last['idle_share']:.1f}%" if "idle_share" in last else ""
            print(
                f"step {step}/{self.total_steps} loss {last['loss']:.4f} lr {last['lr']:.2e}"
                f" {last['step_time_s'] * 1000:.1f} ms/step{idle}",
                file=sys.stdout,
                flush=True,
            )

    def flush(self) -> None:
        """Wait until the records handed over so far are written; raise if that failed."""
        written, self._written = self._written, None
        if written is not None:
            written.result()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
            if self.tensorboard is not None:
                self.tensorboard.close()
            for sink in self.trackers:
                sink.close()
