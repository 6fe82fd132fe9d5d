"""dtk's training loop vs a plain hand-written PyTorch loop: step-time ratio, one process.

Both train the same model (same init), on the same batches, with the same optimizer,
schedule and clipping. Repeats alternate between the two loops so that machine noise hits
both alike; the figure is the median over repeats of (dtk median step / plain median step).

    python benchmarks/overhead.py [--steps 30] [--repeats 5] [--dim 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtk.config.compose import compose  # noqa: E402
from dtk.data.loader import StepBatches, build_dataset  # noqa: E402
from dtk.mesh.mesh import ParallelMesh  # noqa: E402
from dtk.models.build import build_model  # noqa: E402
from dtk.train.loss import TokenCrossEntropy  # noqa: E402
from dtk.train.metrics import MetricsLog  # noqa: E402
from dtk.train.optim import build_optimizer, build_scheduler  # noqa: E402
from dtk.train.task import LmTask  # noqa: E402
from dtk.train.trainer import Trainer  # noqa: E402


def setup(args):
    # The job's own configuration (the schema's defaults but for these keys), typed as a worker gets it.
    cfg = compose([f"model.dim={args.dim}", f"model.num_layers={args.layers}", "model.num_heads=8",
                   f"model.seq_len={args.seq_len}", "data.num_samples=4096", "data.seed=1", "optim.lr=1e-3",
                   "optim.warmup_steps=5"])
    model = build_model(cfg.model, device="cpu", seed=0)
    optimizer = build_optimizer(model.parameters(), optim=cfg.optim)
    scheduler = build_scheduler(optimizer, optim=cfg.optim, total_steps=10_000)
    batches = StepBatches(build_dataset(cfg.data, model=cfg.model), seed=0, global_batch=args.batch,
                          micro_batch=args.micro, dp_rank=0, dp_size=1, device=torch.device("cpu"))
    return model, optimizer, scheduler, batches, cfg.optim.grad_clip


def time_dtk(args, steps: int, start: int, metrics_path: Path) -> list[float]:
    model, optimizer, scheduler, batches, grad_clip = setup(args)
    metrics = MetricsLog(metrics_path, world_size=1, restart=0, global_batch=args.batch,
                         tokens_per_step=args.batch * args.seq_len, total_steps=10**9, log_every=10**9,
                         samples_per_epoch=len(batches.dataset), flops_per_token=None, peak_tflops=None)
    trainer = Trainer(model=model, optimizer=optimizer, scheduler=scheduler, batches=batches,
                      task=LmTask(TokenCrossEntropy()), grad_clip=grad_clip, mesh=ParallelMesh.single())
    times = []
    for step in range(start, start + steps):
        t0 = time.perf_counter()
        result = trainer.step(step)
        metrics.step(step + 1, result)
        times.append(time.perf_counter() - t0)
    batches.close()
    return times


def time_plain(args, steps: int, start: int) -> list[float]:
    model, optimizer, scheduler, batches, grad_clip = setup(args)
    data = [batches.get(step) for step in range(start, start + steps)]  # same batches, loaded up front
    batches.close()
    times = []
    for micro in data:
        t0 = time.perf_counter()
        total = 0.0
        for rows in micro:
            inputs, targets = rows[:, :-1], rows[:, 1:]
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            (loss / len(micro)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="steps dropped from each timing")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ratios, dtk_ms, plain_ms = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            # Alternate which loop goes first, so drift in machine load does not favour one.
            order = ("dtk", "plain") if r % 2 == 0 else ("plain", "dtk")
            got = {}
            for which in order:
                if which == "dtk":
                    got[which] = time_dtk(args, args.steps, 0, Path(tmp) / f"m{r}.jsonl")
                else:
                    got[which] = time_plain(args, args.steps, 0)
            d = statistics.median(got["dtk"][args.warmup:])
            q = statistics.median(got["plain"][args.warmup:])
            dtk_ms.append(d * 1000)
            plain_ms.append(q * 1000)
            ratios.append(d / q)
            print(f"repeat {r}: dtk {d * 1000:.2f} ms/step  plain {q * 1000:.2f} ms/step  ratio {d / q:.4f}", flush=True)
    print(
        f"model dim={args.dim} layers={args.layers} seq={args.seq_len} batch={args.batch} micro={args.micro}"
        f" threads={args.threads}: dtk {statistics.median(dtk_ms):.2f} ms/step, plain {statistics.median(plain_ms):.2f}"
        f" ms/step; dtk / plain = {statistics.median(ratios):.4f} (median of {args.repeats} repeats, target <= 1.02)"
    )


if __name__ == "__main__":
    main()
