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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
_installed: StopFlag | None = None


def stop_flag() -> StopFlag:
    """The process's stop flag, its handler installed on the first call. The worker calls it
    before it imports torch (dtk/worker/__main__.py): a signal that arrives while the worker
    starts (imports, process group, model build, checkpoint load) is kept, not fatal, and
    honoured at the end of the first step, which saves."""
    global _installed
    if _installed is None:
        _installed = StopFlag().install()
    return _installed


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
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
