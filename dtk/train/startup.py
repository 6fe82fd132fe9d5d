"""How long a worker took to reach its first step, in parts, for the goodput account.

The parts are laps of one wall clock, starting when the operating system created the
process (so interpreter start and imports count): imports, process group, model build
(meta init, parallelize, materialize, optimizer). The checkpoint load has its own event.
Rank 0 writes them in the `ready` event just before its first step.
"""

from __future__ import annotations

import os
import time

from dtk.common.processes import process_age


class StartupClock:
    def __init__(self) -> None:
        # Now less the process's age: psutil's create_time adds a boot time the kernel
        # rounds down to the second, which would count up to a second of imports too many.
        age = process_age(os.getpid())
        self.process_start = time.time() - (age or 0.0)  # no /proc: imports are not counted apart
        self._last = self.process_start
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        """The time since the previous lap (or the process start) is `name`_s."""
        now = time.time()
        self.laps[f"{name}_s"] = round(max(0.0, now - self._last), 3)
        self._last = now

    def ready_event(self) -> dict[str, float]:
        """Details of the `ready` event: the process start (epoch seconds) and every lap."""
        return {"process_start": round(self.process_start, 3), **self.laps}
