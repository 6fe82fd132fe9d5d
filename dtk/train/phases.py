"""Where each step's time goes: phase marks taken during the step, read only when logged.

A step is a sequence of laps on one clock: data -> forward -> backward -> optimizer -> comm
(the loss reduction) -> checkpoint (the blocking part of a save). Each lap ends one phase
and begins the next, so the phases add up to the step time by construction. On a GPU the
marks are CUDA events on the compute stream - the accelerator's own timeline, where idle
time is what matters - and on a CPU `perf_counter` readings.

Nothing here forces a host-device synchronisation per step: the marks are resolved into
seconds by `collect()`, which the trainer calls every `train.log_every` steps (one
synchronisation on the last event covers the whole interval).

The gradient synchronisation of data parallelism happens inside backward. A hook on every
parameter marks when this rank's last gradient is ready; the rest of backward is `sync`,
the time spent waiting for the reduction to finish. Across ranks (dtk.train.straggler) the
least `sync` of a step is the exposed communication and the excess over it is waiting for
the slowest rank.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dtk.common.rundir import IDLE_PHASES, PHASES  # noqa: F401  (re-exported for the trainer)

LAPS = ("data", "forward", "backward", "sync", "optimizer", "comm", "checkpoint")
"""What one rank measures; the order of the gathered vectors."""
NOT_STEP = "-"
"""A lap that is no part of the step (an evaluation between two steps): dropped."""

Mark = float | torch.cuda.Event
"""A moment: perf_counter seconds on the CPU, a recorded event on the GPU's stream."""


@dataclass
class StepTimes:
    """One rank's laps of one step, in seconds."""

    step: int
    total_s: float
    laps: dict[str, float]
    overlapped: bool = False  # a background checkpoint write ran during this step

    def vector(self) -> list[float]:
        return [self.total_s, *(self.laps.get(k, 0.0) for k in LAPS)]


@dataclass
class _Step:
    step: int
    marks: list[tuple[str, Mark]] = field(default_factory=list)
    sync_at: Mark | None = None
    overlapped: bool = False


class PhaseTimer:
    """Marks of the steps since the last `collect()`. Disabled, every call returns at once."""

    def __init__(
        self, *, device: torch.device, enabled: bool = True, overlapping: Callable[[], bool] | None = None
    ) -> None:
        self.enabled = enabled
        self.overlapping = overlapping  # whether a background checkpoint write is in flight
        self.cuda = device.type == "cuda"
        self.device = device
        self._steps: list[_Step] = []
        self._current: _Step | None = None
        self._hooks: list = []
        self._num_grads = 0
        self._grads_seen = 0

    def _now(self) -> Mark:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self, step: int) -> None:
        if not self.enabled:
            return
        self._current = _Step(step, [("", self._now())])
        self._current.overlapped = self.overlapping is not None and self.overlapping()
        self._grads_seen = 0

    def lap(self, phase: str) -> None:
        """The time since the previous lap belongs to `phase` (laps of one phase add up)."""
        if not self.enabled or self._current is None:
            return
        cur = self._current
        if phase == "backward" and cur.sync_at is not None:
            cur.marks.append(("backward", cur.sync_at))
            cur.sync_at = None
            phase = "sync"
        cur.marks.append((phase, self._now()))

    def end(self) -> None:
        if not self.enabled or self._current is None:
            return
        self._steps.append(self._current)
        self._current = None

    # --- the gradient-ready mark -------------------------------------------------------

    def watch_gradients(self, params: list[torch.nn.Parameter], *, one: bool = False) -> None:
        """Mark the moment the last of `params` has its gradient (data-parallel reduction
        starts then; what backward takes after it is `sync`). `one`: a hook on the first
        parameter only, whose gradient comes last (FSDP reduces the root unit, which holds
        the embedding, after every block). With CPU offload that matters: FSDP copies the
        gradient of a parameter with a post-accumulate hook to the host blocking (a hook
        may read it), so a hook on every parameter would serialize every copy."""
        if not self.enabled:
            return
        params = params[:1] if one else params
        self._num_grads = len(params)
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, _param) -> None:
        if self._current is None:
            return
        self._grads_seen += 1
        # Only the last gradient's moment matters: on a GPU an event per parameter would
        # cost host time, so only the last one records one.
        if self._grads_seen % self._num_grads == 0:
            self._current.sync_at = self._now()

    # --- reading -------------------------------------------------------------------------

    def _seconds(self, a: Mark, b: Mark) -> float:
        if isinstance(a, torch.cuda.Event) and isinstance(b, torch.cuda.Event):
            return a.elapsed_time(b) / 1000.0
        assert isinstance(a, float) and isinstance(b, float), "one timer marks one kind"
        return b - a

    def collect(self) -> list[StepTimes]:
        """Seconds of every step ended since the last call (one device synchronisation)."""
        steps, self._steps = self._steps, []
        if not steps:
            return []
        if self.cuda:
            last = steps[-1].marks[-1][1]
            assert isinstance(last, torch.cuda.Event)
            last.synchronize()
        out = []
        for s in steps:
            laps = dict.fromkeys(LAPS, 0.0)
            for (_, a), (phase, b) in itertools.pairwise(s.marks):
                if phase != NOT_STEP:
                    laps[phase] += max(0.0, self._seconds(a, b))
            out.append(StepTimes(s.step, sum(laps.values()), laps, s.overlapped))
        return attribute_overlap(out)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def attribute_overlap(steps: list[StepTimes]) -> list[StepTimes]:
    """Steps a background checkpoint write overlapped are slower than the others: that extra
    time, taken from their compute, is the checkpoint's (against the interval's median of
    the steps without a write; none in the interval: nothing to compare, left as it is)."""
    clean = [s.total_s for s in steps if not s.overlapped]
    if not clean or all(not s.overlapped for s in steps):
        return steps
    typical = statistics.median(clean)
    for s in steps:
        if not s.overlapped:
            continue
        extra = max(0.0, s.total_s - s.laps["checkpoint"] - typical)
        compute = sum(s.laps[k] for k in ("forward", "backward", "optimizer"))
        extra = min(extra, compute)
        if compute > 0 and extra > 0:
            scale = (compute - extra) / compute
            for k in ("forward", "backward", "optimizer"):
                s.laps[k] *= scale
            s.laps["checkpoint"] += extra
    return steps
