"""TensorBoard event files next to metrics.jsonl (`tensorboard` in train.tracker, or the older
train.tensorboard=true), same scalars; `scalars` also names the metrics MLflow and W&B get.

Uses torch's own `torch.utils.tensorboard.SummaryWriter`, which needs the `tensorboard`
package (an optional dependency: `pip install -e .[tensorboard]`). That package is also the
viewer a team runs (`tensorboard --logdir RUN_DIR/tensorboard`), so choosing it adds nothing
the user would not install anyway; tensorboardX would be a second writer to keep in step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.common.rundir import TENSORBOARD_DIR

SKIP = {"step", "time", "world_size", "restart", "batch_hash", "ranks"}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record as TensorBoard tags: `loss`, `phases/data`, ..."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in SKIP or value is None:
            continue
        if isinstance(value, dict):
            out.update({f"{key}/{k}": float(v) for k, v in value.items() if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


class TensorBoardLog:
    """Writes every metrics record's scalars at its step, with the record's wall time."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(
                "train.tensorboard=true needs the tensorboard package on the workers:"
                " pip install tensorboard (or pip install -e .[tensorboard]), or set train.tensorboard=false"
            ) from None
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def add(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"], walltime=record.get("time"))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
