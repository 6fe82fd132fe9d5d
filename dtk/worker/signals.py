"""Signal -> flag -> agreement at a step boundary.

A checkpoint written inside a signal handler, or by one rank alone, hangs or comes out
partial. So the handler only records the signal; at the end of every step all ranks
reduce the flag (MAX), and when any rank was signalled they all save together and stop.

SIGUSR2 is what `sbatch --signal=USR2@T` sends ahead of the time limit (NCCL may use
SIGUSR1); SIGTERM is what preemption and scancel send, SIGKILL following after the grace
time.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class StopFlag:
    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> StopFlag:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = signum

    def agreed(self, device: torch.device) -> int:
        """Collective: the signal any rank received (0 if none). Every rank gets the same."""
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
