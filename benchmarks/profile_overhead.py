"""The step profiler's own cost: the same training run with phase timing on and off, ratio.

Two gloo ranks train one model with DDP through `Trainer.fit` with the worker's profiler
and metrics log. The run is cut into segments of `--segment` steps (a multiple of
`--log-every`, so each "on" segment pays its interval reads: the all-gather of every
rank's times and the records' write); segments alternate between profiling on (laps,
gradient-ready hooks, gather) and off (no laps, no hooks, records written without phases),
so machine noise hits both alike. The figure is the median over pairs of (mean step of
the "on" segment / mean step of the "off" one), each step timed from outside the loop (the
mean, so that the interval's read at its last step counts). Target: < 1.01. Also printed:
the median step with profiling on over the median step with it off, over all segments (a
median leaves out the one step in ten that reads the interval).

On a shared machine that ratio is as noisy as the machine (a few percent from one pair to
the next), far above what it measures; so the profiler's own time is also measured
directly, in a last profiled segment: every call of the timer (laps, the gradient-ready
hook) and of the interval read timed from inside, their sum over the segment's step time.

    python benchmarks/profile_overhead.py [--pairs 20] [--segment 10] [--dim 256] [--layers 4]
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
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtk.common.rundir import RunDir  # noqa: E402
from dtk.data.loader import StepBatches  # noqa: E402
from dtk.data.synthetic import SyntheticTokens  # noqa: E402
from dtk.mesh.mesh import build_mesh  # noqa: E402
from dtk.models.transformer import build  # noqa: E402
from dtk.plan.degrees import Degrees  # noqa: E402
from dtk.train.loss import TokenCrossEntropy  # noqa: E402
from dtk.train.metrics import MetricsLog  # noqa: E402
from dtk.train.policies import StepPolicies  # noqa: E402
from dtk.train.profile import StepProfiler  # noqa: E402
from dtk.train.task import LmTask  # noqa: E402
from dtk.train.trainer import Trainer  # noqa: E402

WORLD = 2


class Nothing:
    def after_step(self, step, result=None) -> None:
        pass


class CallClock:
    """Seconds spent inside the wrapped callables."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


class StepClock:
    """Every step's wall time, from outside the profiler: the time between consecutive
    calls of the last policy."""

    def __init__(self, inner) -> None:
        self.inner, self.times, self._last = inner, [], None

    def after_step(self, step, result=None) -> None:
        self.inner.after_step(step, result)
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now

    def flush(self) -> None:
        self.inner.flush()


def worker(rank: int, args, folder: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD)
    run = RunDir(Path(folder))
    mesh = build_mesh(Degrees(dp_replicate=1, pp=1, dp_shard=WORLD, tp=1), "cpu")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        build(vocab_size=4096, dim=args.dim, num_layers=args.layers, num_heads=8, seq_len=args.seq_len))
    data = SyntheticTokens(num_samples=4096, seq_len=args.seq_len, vocab_size=4096, seed=1, branching=4)
    batches = StepBatches(data, seed=0, global_batch=args.batch, micro_batch=args.batch // WORLD,
                          dp_rank=mesh.dp_rank, dp_size=WORLD, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    total = args.log_every + (2 * args.pairs + 1) * args.segment
    metrics = MetricsLog(run.metrics if rank == 0 else None, world_size=WORLD, restart=0, global_batch=args.batch,
                         tokens_per_step=args.batch * args.seq_len, total_steps=total, log_every=args.log_every,
                         samples_per_epoch=len(data), flops_per_token=None, peak_tflops=None)
    profile = StepProfiler(device=torch.device("cpu"), enabled=True, straggler_factor=0.0, run=None, rank=rank,
                           log_every=args.log_every, total_steps=total, metrics=metrics, saving=None)
    trainer = Trainer(model=model, optimizer=optimizer,
                      scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), batches=batches,
                      task=LmTask(TokenCrossEntropy()), grad_clip=1.0, mesh=mesh, timer=profile.timer)
    params = [p for p in model.parameters() if p.requires_grad]
    trainer.fit(start_step=0, total_steps=args.log_every, policies=_policies(metrics, StepClock(profile)))  # warm-up
    ratios = []
    steps = {True: [], False: []}  # every step's time, on and off
    step = args.log_every
    for pair in range(args.pairs):
        medians = {}
        order = (True, False) if pair % 2 == 0 else (False, True)
        for on in order:
            timer = profile.timer
            timer.close()  # off: no gradient hooks; on: hooks again
            timer.enabled = profile.enabled = on
            if on:
                timer.watch_gradients(params)
            clock = StepClock(profile)
            trainer.fit(start_step=step, total_steps=step + args.segment, policies=_policies(metrics, clock))
            step += args.segment
            medians[on] = statistics.fmean(clock.times)  # the interval's read and write included
            steps[on] += clock.times
        ratios.append(medians[True] / medians[False])
        if rank == 0:
            print(f"pair {pair}: on {medians[True] * 1000:.2f} ms/step  off {medians[False] * 1000:.2f} ms/step"
                  f"  ratio {ratios[-1]:.4f}", flush=True)
    # The profiler's own time, from inside its calls.
    timer, calls = profile.timer, CallClock()
    timer.close()
    timer.enabled = profile.enabled = True
    for name in ("begin", "lap", "end", "_grad_ready"):
        setattr(timer, name, calls.wrap(getattr(timer, name)))
    profile.read = calls.wrap(profile.read)
    timer.watch_gradients(params)  # registers the wrapped hook
    clock = StepClock(profile)
    t0 = time.perf_counter()
    trainer.fit(start_step=step, total_steps=step + args.segment, policies=_policies(metrics, clock))
    own = calls.seconds / (time.perf_counter() - t0)
    if rank == 0:
        quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
        print(f"model dim={args.dim} layers={args.layers} seq={args.seq_len} batch={args.batch} ({WORLD} gloo ranks,"
              f" DDP, {args.threads} thread(s) each), log_every={args.log_every}, {args.pairs} pairs of"
              f" {args.segment}-step segments: profiled / not = {statistics.median(ratios):.4f} (median of pairs;"
              f" quartiles {quartiles[0]:.4f}-{quartiles[2]:.4f}, range {min(ratios):.4f}-{max(ratios):.4f},"
              f" on slower in {sum(r > 1 for r in ratios)} of {len(ratios)}); median step on / off ="
              f" {statistics.median(steps[True]) / statistics.median(steps[False]):.4f} ({len(steps[True])} steps"
              f" each); the profiler's own time"
              f" {100 * own:.3f}% of the steps (rank 0); target < 1%", flush=True)
    batches.close()
    dist.destroy_process_group()


def _policies(metrics, profile) -> StepPolicies:
    return StepPolicies(metrics=metrics, heartbeat=Nothing(), resumed=Nothing(), evaluation=Nothing(),
                        checkpoint=Nothing(), stop=Nothing(), profile=profile)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--segment", type=int, default=10, help="steps per segment (a multiple of --log-every)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if args.segment % args.log_every:
        sys.exit("error: --segment must be a multiple of --log-every")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args, tmp), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
