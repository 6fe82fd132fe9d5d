"""What the peer loops share with dtk: the same model (dtk's built-in transformer), the same
batches (dtk's world-size-invariant order, this rank's share) and the same AdamW and
schedule, built from the same overrides dtk.submit is given (benchmarks/peers.py).

Each loop logs one JSON line per optimizer step on rank 0 (`step`, `time`, `restart`) to
LOG, and every rank writes its pid to pids/<rank> at the start, so the benchmark can kill a
worker. A checkpoint is one file, written by rank 0 (temp file, then rename: a kill during
the write leaves the previous one).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dtk.config.compose import compose  # noqa: E402
from dtk.data.loader import StepBatches, build_dataset  # noqa: E402
from dtk.models.build import build_model  # noqa: E402
from dtk.train.optim import build_optimizer, build_scheduler  # noqa: E402

LOG = "steps.jsonl"
CHECKPOINT = "checkpoint.pt"


def setup(overrides: list[str], *, rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # what dtk's workers choose on CPU
    cfg = compose(overrides)
    seed = cfg.train.seed
    model = build_model(cfg.model, device="cpu", seed=seed)
    optimizer = build_optimizer(model.parameters(), optim=cfg.optim)
    scheduler = build_scheduler(optimizer, optim=cfg.optim, total_steps=cfg.train.steps)
    global_batch = cfg.train.global_batch
    batches = StepBatches(build_dataset(cfg.data, model=cfg.model), seed=seed, global_batch=global_batch,
                          micro_batch=global_batch // world_size, dp_rank=rank, dp_size=world_size,
                          device=torch.device("cpu"))
    torch.manual_seed(seed + rank)
    return {"cfg": cfg, "model": model, "optimizer": optimizer, "scheduler": scheduler, "batches": batches,
            "steps": cfg.train.steps, "every": cfg.checkpoint.every, "grad_clip": cfg.optim.grad_clip}


def loss_of(model, rows: torch.Tensor) -> torch.Tensor:
    inputs, targets = rows[:, :-1], rows[:, 1:]
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def write_pid(out: Path, rank: int) -> None:
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / str(rank)).write_text(str(os.getpid()))


def log_step(out: Path, record: dict[str, Any]) -> None:
    with open(out / LOG, "a") as fh:
        fh.write(json.dumps({**record, "time": time.time()}) + "\n")
