"""A plain DDP loop, as a torchrun user writes it (gloo, CPU): `torchrun --nproc-per-node 2
plain_ddp.py OUT OVERRIDES...`. Resumes from OUT/checkpoint.pt (torch.save of model,
optimizer, schedule and step, by rank 0) when it exists; saves every checkpoint.every steps."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CHECKPOINT, log_step, loss_of, setup, write_pid  # noqa: E402


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    write_pid(out, rank)
    s = setup(overrides, rank=rank, world_size=world)
    model, optimizer, scheduler, batches = s["model"], s["optimizer"], s["scheduler"], s["batches"]
    ddp = DDP(model)
    start = 0
    if (out / CHECKPOINT).exists():
        state = torch.load(out / CHECKPOINT, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = state["step"]
    restart = int(os.environ.get("PEER_RESTART", "0"))
    for step in range(start, s["steps"]):
        t_step = time.perf_counter()
        (rows,) = batches.get(step)
        loss = loss_of(ddp, rows)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), s["grad_clip"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        step_time = time.perf_counter() - t_step
        done = step + 1
        save_s = None
        if s["every"] and done % s["every"] == 0:
            t0 = time.perf_counter()
            if rank == 0:
                tmp = out / f"{CHECKPOINT}.tmp"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "step": done}, tmp)
                os.replace(tmp, out / CHECKPOINT)
            dist.barrier()
            save_s = time.perf_counter() - t0
        if rank == 0:
            log_step(out, {"step": done, "loss": loss_value, "restart": restart, "save_s": save_s,
                             "step_time_s": step_time})
    batches.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
