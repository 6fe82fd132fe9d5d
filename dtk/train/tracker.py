"""The team's experiment tracker (train.tracker: mlflow, wandb): one tracker run per dtk run.

Rank 0 hands each metrics record to one `TrackerSink` per tracker; the sink's own thread
logs it, so a slow or unreachable tracker costs the training thread (and the metrics
writer thread) nothing. The clients themselves are in dtk/train/tracker_clients.py.

One run for the run's whole life: the tracker run's id is kept in `<run dir>/tracker.json`
(dtk.common.rundir.TRACKER_STATE) with the last step it holds, and every later start (relaunch,
requeue, shrink or grow, resubmission) logs to that run again.

Each step once: a tracker's history keeps every value logged for a step (MLflow keeps a
redone step twice), so a sink logs a step only when it is past the last step the tracker
holds: the larger of what tracker.json says and what the tracker itself reports (a start
killed after the tracker took a batch, before tracker.json was rewritten). A step redone
after a resume keeps, in the tracker, the value it was first logged with; metrics.jsonl
has both.

Catching up: what a start logged to metrics.jsonl but its tracker never received (the
tracker was down, the start was killed with records in the sink's buffer) is read back
from metrics.jsonl by the next start, up to the file's size when the sink was made (the
records after that are the new start's own, handed over as they come).

Unreachable: a failed call is one `tracker_unreachable` event, then retries with backoff
(1 s doubling to 60 s) while the records wait in the buffer; the first call that works
again logs them all and is one `tracker_caught_up` event. At the end of the run a sink that works
drains its buffer (up to 60 s; 5 s for a start that stops short, which must exit within its
signal's lead); one that fails tries once more and gives up (the next start, if any,
catches up from metrics.jsonl).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from dtk.common.rundir import write_json_atomic

BACKOFF_S = (1.0, 60.0)  # first retry delay, doubling up to the cap
DRAIN_S = 60.0  # the longest the end of the run waits for a tracker that works to take its buffer
STOPPING_DRAIN_S = 5.0  # the same for a start that stops short (preempted, time limit): the next one catches up
BATCH = 200  # records per call


class Client(Protocol):
    """One tracker: `open` creates the tracker run (or reopens `run_id`), tags it with the
    run's Slurm job ids so far, and returns its id and the last step it already holds
    (None: it cannot say); a client that chooses a new run's id itself hands it to
    `remember` first, so that a start killed while the run is made leaves it in
    tracker.json. `log` sends records in step order. Both raise when the tracker cannot be
    reached."""

    name: str

    def open(self, run_id: str | None, job_ids: list[str], remember: Callable[[str], None]
             ) -> tuple[str, int | None]: ...

    def log(self, records: list[dict[str, Any]]) -> None: ...

    def close(self, *, finished: bool) -> None: ...


def read_state(path: Path) -> dict[str, dict[str, Any]]:
    """tracker.json: per tracker name, {"run_id": ..., "last_step": ...}; {} when none yet."""
    try:
        state = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


_STATE_LOCK = threading.Lock()  # the sinks of one process share the file


def update_state(path: Path, name: str, **fields: Any) -> None:
    with _STATE_LOCK:
        state = read_state(path)
        state[name] = {**state.get(name, {}), **fields}
        write_json_atomic(path, state)


def new_steps(records: Iterable[dict[str, Any]], last_step: int) -> tuple[list[dict[str, Any]], int]:
    """The records of steps past `last_step`, in order, each step once (a redone step, or
    one read back from metrics.jsonl and also handed over again, is left out), and the new
    last step."""
    kept = []
    for record in records:
        step = int(record["step"])
        if step > last_step:
            kept.append(record)
            last_step = step
    return kept, last_step


def records_before(metrics: Path, size: int) -> Iterator[dict[str, Any]]:
    """metrics.jsonl's records in its first `size` bytes (what earlier starts wrote), read
    as a stream (a weeks-long run's file is large; only the records a tracker lacks are
    kept); a torn line (a writer killed mid-write) is skipped."""
    if size <= 0:
        return
    with open(metrics, "rb") as fh:
        read = 0
        for line in fh:
            read += len(line)
            if read > size:
                return
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "step" in record:
                yield record


class TrackerSink:
    """One tracker's thread: buffers the records handed to `add` and logs them, each step
    once, retrying with backoff while the tracker cannot be reached."""

    def __init__(self, client: Client, *, state: Path, metrics: Path, event: Callable[..., None],
                 total_steps: int, job_id: str | None = None, backoff_s: tuple[float, float] = BACKOFF_S, drain_s: float = DRAIN_S) -> None:
        self.client = client
        self.state = state
        self.metrics = metrics
        self.event = event
        self.total_steps = total_steps
        self.job_id = job_id
        self.backoff_s = backoff_s
        self.drain_s = drain_s
        self.earlier = metrics.stat().st_size if metrics.exists() else 0  # what earlier starts wrote
        self.queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue()
        self.run_id: str | None = None
        self.handed = 0  # the newest step handed over
        self.last_step = 0
        self.failing = False
        self.thread = threading.Thread(target=self._run, name=f"dtk-tracker-{client.name}", daemon=True)
        self.thread.start()

    def add(self, records: list[dict[str, Any]]) -> None:
        """Hand records over; never waits."""
        if records:
            self.handed = max(self.handed, int(records[-1]["step"]))
        self.queue.put(records)

    def close(self) -> None:
        """The start's end: a tracker that works takes the buffer (up to DRAIN_S at the
        run's end; a start that stops short must exit within its signal's lead, and the next
        start reads what is left back from metrics.jsonl), one that fails is tried once more."""
        self.queue.put(None)
        ending = self.handed >= self.total_steps
        self.thread.join(timeout=self.drain_s if ending else min(self.drain_s, STOPPING_DRAIN_S))

    def _run(self) -> None:
        pending: list[dict[str, Any]] = []
        delay = self.backoff_s[0]
        closing = False
        while True:
            try:
                if self.run_id is None:  # at once: the run's name, tags and params before its first step
                    pending[:0] = self._open()
                self._log(pending)
                pending = []
            except Exception as exc:  # unreachable, or refused: training goes on, the records wait
                if self.failing:
                    delay = min(delay * 2, self.backoff_s[1])
                else:
                    self.failing, delay = True, self.backoff_s[0]
                    self.event("tracker_unreachable", tracker=self.client.name, step=self.last_step,
                               error=f"{type(exc).__name__}: {exc}"[:300])
                if closing:
                    return
            else:
                if self.failing:
                    self.failing = False
                    self.event("tracker_caught_up", tracker=self.client.name, step=self.last_step)
                if closing:
                    try:
                        self.client.close(finished=self.last_step >= self.total_steps)
                    except Exception:
                        pass  # what it holds is logged; closing it is a courtesy
                    return
            closing = self._gather(pending, timeout=delay if self.failing else None)

    def _gather(self, pending: list[dict[str, Any]], *, timeout: float | None) -> bool:
        """Wait for records (while failing, only until the next retry) and take all that
        came; whether the start is ending."""
        closing = False
        try:
            item = self.queue.get(timeout=timeout)
            while True:
                if item is None:
                    closing = True
                else:
                    pending.extend(item)
                item = self.queue.get_nowait()
        except queue.Empty:
            pass
        return closing

    def _open(self) -> list[dict[str, Any]]:
        """Create or reopen the tracker run; the records of earlier starts it lacks."""
        known = read_state(self.state).get(self.client.name, {})
        jobs = list(known.get("job_ids") or [])
        jobs += [self.job_id] if self.job_id and self.job_id not in jobs else []
        run_id, held = self.client.open(known.get("run_id"), jobs,
                                        lambda new: update_state(self.state, self.client.name, run_id=new))
        self.run_id = run_id
        self.last_step = max(int(known.get("last_step") or 0), held or 0)
        update_state(self.state, self.client.name, run_id=run_id, last_step=self.last_step, job_ids=jobs)
        return new_steps(records_before(self.metrics, self.earlier), self.last_step)[0]

    def _log(self, pending: list[dict[str, Any]]) -> None:
        kept, last = new_steps(pending, self.last_step)
        for i in range(0, len(kept), BATCH):
            batch = kept[i:i + BATCH]
            self.client.log(batch)
            self.last_step = int(batch[-1]["step"])
            update_state(self.state, self.client.name, last_step=self.last_step, time=round(time.time(), 3))
        assert self.last_step == last or not kept

