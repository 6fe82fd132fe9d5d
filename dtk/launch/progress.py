"""Follow a run's progress from its metrics.jsonl: step / total, loss, speed, ETA."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO


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
        self._offset = 0
        self._last_printed = -1
        self._last: dict | None = None
        self._times: list[float] = []

    def skip_existing(self) -> None:
        """Follow from now on: records of earlier starts are not reprinted."""
        try:
            self._offset = self.metrics.stat().st_size
        except FileNotFoundError:
            self._offset = 0

    def _read_new(self) -> list[dict]:
        try:
            with open(self.metrics, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self._offset += end
        records = []
        for line in chunk[:end].splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def poll(self, final: bool = False) -> dict | None:
        for rec in self._read_new():
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
        print(
            f"[{bar}] step {step}/{self.total} loss {rec['loss']:.4f} lr {rec['lr']:.2e}"
            f" {per_step * 1000:.0f} ms/step ETA {eta}{state}",
            file=self.out,
            flush=True,
        )
        self._last_printed = step

