"""The same loop under Lightning Fabric (2 CPU processes, strategy ddp, gloo):
`python fabric_loop.py OUT OVERRIDES...`; Fabric launches the processes itself. Resumes
from OUT/checkpoint.pt with fabric.load when it exists; saves with fabric.save every
checkpoint.every steps."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from lightning_fabric import Fabric
from lightning_fabric.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CHECKPOINT, log_step, loss_of, setup, write_pid  # noqa: E402

WORLD = 2


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=DDPStrategy(process_group_backend="gloo"))
    fabric.launch()
    rank = fabric.global_rank
    write_pid(out, rank)
    s = setup(overrides, rank=rank, world_size=WORLD)
    model, optimizer, scheduler, batches = s["model"], s["optimizer"], s["scheduler"], s["batches"]
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if (out / CHECKPOINT).exists():
        fabric.load(out / CHECKPOINT, state)
    restart = int(os.environ.get("PEER_RESTART", "0"))
    for step in range(state["step"], s["steps"]):
        t_step = time.perf_counter()
        (rows,) = batches.get(step)
        loss = loss_of(model, rows)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=s["grad_clip"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        step_time = time.perf_counter() - t_step
        done = step + 1
        save_s = None
        if s["every"] and done % s["every"] == 0:
            t0 = time.perf_counter()
            state["step"] = done
            fabric.save(out / CHECKPOINT, state)  # rank 0 writes; Fabric's barrier after
            save_s = time.perf_counter() - t0
        if rank == 0:
            log_step(out, {"step": done, "loss": loss_value, "restart": restart, "save_s": save_s,
                             "step_time_s": step_time})
    batches.close()


if __name__ == "__main__":
    main()
