"""summary.json: a finished run's last word, written by global rank 0 after the final
checkpoint. The worker hands the figures only it can know (its device's peak memory, every
rank's measured memory, the FLOPs its metrics counted); the rest is read here from the run
directory (the final step's loss, the goodput of every start)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from dtk.common.rundir import RunDir, read_jsonl, write_json_atomic
from dtk.report.goodput import account


@dataclass(frozen=True)
class Finished:
    """The run as the worker saw it end."""

    final_step: int
    last_loss: float | None
    """The loss of the last step this start ran, for a final step metrics.jsonl has no record of."""
    restarts: int
    world_size: int
    scheme: str
    config_hash: str
    data_version: str
    peak_memory_gib: float | None
    """Rank 0's GPU; None on the CPU."""
    memory: dict[str, Any] | None
    """Every rank's measured bytes against the plan's (dtk.worker.memory.gather_memory)."""
    flops_per_token: float | None
    peak_tflops: float | None


def write_summary(run: RunDir, finished: Finished) -> dict[str, Any]:
    """Write summary.json and the `finished` event; return the summary."""
    final = run.latest_metrics().get(finished.final_step)
    summary = {
        "status": "finished",
        "final_step": finished.final_step,
        "final_loss": final["loss"] if final else finished.last_loss,
        "restarts": finished.restarts,
        "world_size": finished.world_size,
        "scheme": finished.scheme,
        "config_hash": finished.config_hash,
        "data_version": finished.data_version,
        "peak_memory_gib": finished.peak_memory_gib,
        "memory": finished.memory,
        "flops_per_token": finished.flops_per_token,
        "peak_tflops": finished.peak_tflops,
        "goodput": account(run.events_list(), list(read_jsonl(run.metrics)), end=time.time()),
    }
    write_json_atomic(run.summary, summary)
    run.event("finished", step=finished.final_step, final_loss=summary["final_loss"])
    return summary
