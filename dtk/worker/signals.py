"""Signal -> flag -> agreement at a step boundary.

A checkpoint written inside a signal handler, or by one rank alone, hangs or comes out
partial. So the handler only records the signal; every few steps all ranks reduce the flag
(MAX), and when any rank was signalled they all save together and stop.

The reduction runs on a gloo group of host tensors (`vote_group`), not on the GPU's NCCL
group: the flag is host state, and a device collective read back by the host would make
the host wait for the GPU's whole queue (dtk.train.policies.AgreedStop says how often).

SIGUSR2 is what `sbatch --signal=USR2@T` sends ahead of the time limit (NCCL may use
SIGUSR1); SIGTERM is what preemption and scancel send, SIGKILL following after the grace
time.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import TYPE_CHECKING

from dtk.mesh.host import host_only

if TYPE_CHECKING:
    import torch.distributed as dist

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

    def vote(self, group: dist.ProcessGroup | None, seconds: float = 0.0) -> tuple[int, float]:
        """Collective over `group` (a gloo group; None: this process alone): the signal any
        rank received (0 if none) and the largest `seconds` any rank gave. Every rank gets
        the same pair, so decisions made from it (when to vote next) agree."""
        if group is None:
            return self.signum, seconds
        import torch
        import torch.distributed as dist

        with host_only():
            values = torch.tensor([float(self.signum), seconds], dtype=torch.float64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
            signum, agreed_s = values.tolist()
        return int(signum), agreed_s

    def agreed(self, group: dist.ProcessGroup | None) -> int:
        """Collective: the signal any rank received (0 if none). Every rank gets the same."""
        return self.vote(group)[0]


def vote_group() -> dist.ProcessGroup | None:
    """Collective (every rank at the same point): the host group the stop votes run on."""
    import torch.distributed as dist

    from dtk.mesh.groups import new_group

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return new_group(backend="gloo")  # the world's timeout (dist.timeout_s)
