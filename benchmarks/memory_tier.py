"""The in-memory snapshot tier's cost (checkpoint.memory_every) on the built-in model.

One process trains the built-in transformer (its defaults: `dtk.models.transformer.build()`)
with dtk's optimizer and schedule on one rank's share of the default global batch, and
snapshots through dtk's MemoryTier, the code a worker runs (no replica: one process is one
node). Per repeat it runs --steps steps without the tier, then --steps with a snapshot every
--every steps, and reports medians over the repeats:

  step          a step without the tier
  blocked       the training thread's time per snapshot: the copy to CPU (and a wait for
                the previous snapshot's background write, if it was not done)
  slowdown      how much longer the steps with the tier took in all, beyond the blocking,
                per snapshot (the background thread's serialize + CRC + write share the CPU)
  cost          (blocked + slowdown) / (every x step): the share of training time the tier takes

    python benchmarks/memory_tier.py --every 10 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtk.checkpoint.memory.tier import MemoryTier  # noqa: E402
from dtk.common.rundir import MEMORY_STORE_ENV  # noqa: E402
from dtk.config.schema import OptimConfig  # noqa: E402
from dtk.models.transformer import build  # noqa: E402
from dtk.train.optim import SchedulerGroup, build_optimizer, build_scheduler  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, nargs="+", default=[2, 5, 10, 20])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="samples per step: the default 128 over 2 workers")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build()
    optimizer = build_optimizer(model.parameters(), optim=OptimConfig())
    scheduler = SchedulerGroup([build_scheduler(optimizer, optim=OptimConfig(), total_steps=10**6)])
    tokens = torch.randint(0, model.vocab_size if hasattr(model, "vocab_size") else 256, (args.batch, 65))

    def step() -> float:
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        os.environ[MEMORY_STORE_ENV] = tmp
        tier = MemoryTier(Path(tmp) / "run", every=1, rank=0, world=1, local_rank=0, per_node=1,
                          parts=[(model, optimizer)], scheduler=scheduler, identity={}, fresh=True)
        for _ in range(5):
            step()
        tier.snapshot(0)
        tier.wait()
        nbytes = sum(f.stat().st_size for f in Path(tmp).rglob("own_*.pt"))
        print(f"built-in model: {sum(p.numel() for p in model.parameters()):,} parameters, snapshot {nbytes / 1e6:.2f}"
              f" MB, batch {args.batch} x 64 tokens, {torch.get_num_threads()} threads")
        print(f"{'every':>6} {'step_ms':>8} {'blocked_ms':>10} {'blocked%':>9} {'slowdown_ms':>11} {'cost%':>6}")
        for every in args.every:
            rows = []
            for _ in range(args.repeats):
                off = [step() for _ in range(args.steps)]
                tier.blocked_s.clear()
                on = []
                for i in range(1, args.steps + 1):
                    on.append(step())
                    if i % every == 0:
                        t0 = time.perf_counter()
                        tier.snapshot(i)
                        on[-1] += time.perf_counter() - t0
                tier.wait()
                snaps = len(tier.blocked_s)
                blocked = statistics.median(tier.blocked_s)
                step_s = statistics.median(off)
                slowdown = max(0.0, (sum(on) - sum(off) - sum(tier.blocked_s)) / snaps)
                rows.append((step_s, blocked, slowdown, (blocked + slowdown) / (every * step_s)))
            s, b, d, c = (statistics.median(r[k] for r in rows) for k in range(4))
            print(f"{every:>6} {s * 1e3:>8.2f} {b * 1e3:>10.3f} {100 * b / s:>8.1f}% {d * 1e3:>11.3f} {100 * c:>5.2f}%")
        tier.close(discard=True)


if __name__ == "__main__":
    main()
