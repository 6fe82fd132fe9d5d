"""Follow a run's progress from its metrics.jsonl: step / total, loss, speed, ETA."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from dtk.common.rundir import EVAL_LOG


def fmt_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class Progress:
    """Prints a line every `every` steps (and the last). Reads only what was appended since
    the last poll, so following a long run costs nothing."""

    def __init__(
        self,
        metrics: Path,
        *,
        total: int,
        every: int,
        out: TextIO = sys.stdout,
        state: Callable[[], str] | None = None,
    ) -> None:
        self.metrics = metrics
        self.total = total
        self.every = max(1, every)
        self.out = out
        self.state = state
        self._tail = _Tail(metrics)
        self._eval_tail = _Tail(metrics.parent / EVAL_LOG)  # validation lines, shown with the next step line
        self._eval: dict | None = None
        self._last_printed = -1
        self._last: dict | None = None
        self._times: list[float] = []

    def skip_existing(self) -> None:
        """Follow from now on: records of earlier starts are not reprinted."""
        self._tail.skip_existing()
        self._eval_tail.skip_existing()

    def poll(self, final: bool = False) -> dict | None:
        for rec in self._eval_tail.read_new():
            self._eval = rec
        for rec in self._tail.read_new():
            self._last = rec
            self._times = (self._times + [rec.get("step_time_s", 0.0)])[-50:]
            step = rec["step"]
            if step % self.every == 0 or step == self.total:
                self._print(rec)
        if final and self._last is not None and self._last_printed != self._last["step"]:
            self._print(self._last)
        return self._last

    def _print(self, rec: dict) -> None:
        step = rec["step"]
        per_step = sorted(self._times)[len(self._times) // 2] if self._times else 0.0
        eta = fmt_eta(per_step * (self.total - step))
        width = 20
        filled = int(width * step / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        state = f" [{self.state()}]" if self.state else ""
        val = ""
        if self._eval is not None:
            shown = " ".join(f"{k} {v:.4f}" for k, v in self._eval.items() if k.startswith("val_") and isinstance(v, float))
            val = f" | {shown} (step {self._eval.get('step')})"
        print(
            f"[{bar}] step {step}/{self.total} loss {rec['loss']:.4f} lr {rec['lr']:.2e}"
            f" {per_step * 1000:.0f} ms/step ETA {eta}{val}{state}",
            file=self.out,
            flush=True,
        )
        self._last_printed = step


class _Tail:
    """The complete JSON lines appended to a file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def skip_existing(self) -> None:
        try:
            self.offset = self.path.stat().st_size
        except FileNotFoundError:
            self.offset = 0

    def read_new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offset += end
        records = []
        for line in chunk[:end].splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records
