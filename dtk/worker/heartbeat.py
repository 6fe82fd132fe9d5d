"""A file whose modification time says "the workers are making progress".

Global rank 0 touches it at the start of every step's end work and after it; a rank that
stops (a SIGSTOP, a collective that never completes) stops rank 0 too at the next
collective, so one file is enough for the driver to see a hang.
"""

from __future__ import annotations

import os
from pathlib import Path

HEARTBEAT = "heartbeat"


class Heartbeat:
    def __init__(self, path: Path | None) -> None:
        self.path = path  # None on ranks other than 0

    def beat(self) -> None:
        if self.path is None:
            return
        try:
            os.utime(self.path)
        except FileNotFoundError:
            self.path.touch()
