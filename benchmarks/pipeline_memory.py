"""Peak memory of a 1F1B pipeline step against the number of micro-batches per step.

Each layout (pp x tp, on pp x tp CPU processes over gloo) runs the built-in transformer
with a large vocabulary, so that the logits are the largest activation, as in big language
models: per micro-batch --micro-batch rows of --seq-len tokens over --vocab logits. For each
count of micro-batches per step it starts fresh processes (spawned: no memory inherited),
builds the model as a worker does (dtk.parallel.parallelize), runs --steps schedule steps
with the optimizer, and reads in each rank

  peak       the process's peak resident set (getrusage ru_maxrss) after the steps
  growth     peak minus the resident set just before the first step (what the steps added)

and prints the largest over the ranks of each, and per layout the ratio of the peaks (and
of the growths) at the largest count to the second largest: the goal is a peak that does
not depend on the micro-batches per step (ratio < 1.05).

With --tensors each rank also runs under torch.profiler with profile_memory, from before
the model is built to the last step: every allocation and free of a tensor's storage by
the CPU allocator is an event, and their running sum's largest value is the rank's peak of
live tensor bytes. That is what dtk's budget predicts (parameters, gradients, optimizer
state, activations, buffers: its total without the margin for fragmentation and the
process, and without the checkpoint's staged copy, as no checkpoint is taken); the
resident set also holds the interpreter, torch and the allocator's slack. It prints both
for the largest rank, their ratio, and the ratio of the rank furthest from its budget.
A layout PPxTPxDP runs ZeRO-1 over DP replicas with tp and pp (+scheme=zero_tp_pp).

The ranks run with MALLOC_MMAP_THRESHOLD_=65536 (unless --glibc-default): every large
tensor is then its own mapping, returned to the system when freed, so the resident set
follows the tensors alive. With glibc's default, a freed large block raises the threshold
and later blocks of that size come from the heap, where tensors of different lifetimes
interleave and the heap grows by fragmentation: the resident set then grows with the
micro-batches even when the tensors alive do not (measured: docs/benchmarks.md).

    python benchmarks/pipeline_memory.py
    python benchmarks/pipeline_memory.py --layouts 2x1 4x2 --micro 4 16 64 --steps 2
    python benchmarks/pipeline_memory.py --layouts 2x1 --micro 4 16 64 --glibc-default
    python benchmarks/pipeline_memory.py --layouts 2x1 2x2 4x1 4x2 2x2x2 --micro 4 16 64 --tensors
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_tensor_peak(prof) -> int:
    """The largest sum of bytes of tensor storages alive at once in a profiled window
    (torch.profiler with profile_memory: every allocation and free of a storage by the CPU
    allocator is an event with its address). A free happens in the profiled thread or in
    another one (the outputs of a functional collective, which tensor parallelism's
    activations are, are freed where the collective is waited for, off the profiled
    thread): such a free is not seen, but an allocation at an address still counted alive
    shows it (the allocator never hands out a live address), so the earlier storage is
    counted freed there. What is freed unseen and never reused stays counted: the figure
    can be above the tensors really alive, never below."""
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if str(node.tag) == "_EventType.Allocation":
            allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        stack.extend(node.children)
    alive: dict[int, int] = {}
    live = peak = 0
    for _, ptr, nbytes in sorted(allocations):
        if nbytes > 0:
            live += nbytes - alive.get(ptr, 0)  # an address handed out again was freed before
            alive[ptr] = nbytes
        elif ptr in alive:
            live -= alive.pop(ptr)
        peak = max(peak, live)
    return peak


def rank_main(rank: int, world: int, folder: str, plan_json: str, steps: int, tensors: bool) -> None:
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    # --tensors: every tensor this rank allocates, from before the model exists to the last step
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if tensors else None
    with prof if prof is not None else contextlib.nullcontext():
        peak, growth = _steps(plan_json, steps)
    result = {"peak": peak, "growth": growth}
    if prof is not None:
        result["tensors"] = live_tensor_peak(prof) / 2**20
    torch.save(result, f"{folder}/result_{rank}.pt")
    dist.destroy_process_group()


def _steps(plan_json: str, steps: int) -> tuple[float, float]:
    """Build the model as a worker does and run `steps` schedule steps with the optimizer:
    (peak resident set, its growth over the steps), MiB."""
    import torch
    import torch.distributed as dist

    from dtk.mesh.mesh import build_mesh
    from dtk.models.build import ParallelSpec, build_model, materialize
    from dtk.parallel.parallelize import parallelize
    from dtk.plan.layout import uses_zero1, zero1_reduces_gradients
    from dtk.plan.plan import Plan
    from dtk.train.loss import TokenCrossEntropy
    from dtk.train.optim import build_optimizer

    plan = Plan.from_json(plan_json)
    cfg = plan.config
    mesh = build_mesh(plan.degrees, "cpu")
    model = parallelize(
        build_model(cfg.model, device="meta", seed=0), mesh=mesh, scheme=cfg.scheme,
        spec=ParallelSpec.from_config(cfg.model), device=torch.device("cpu"),
        materialize=lambda parts, on: materialize(parts, model_cfg=cfg.model, device=on, seed=0),
        loss_fn=TokenCrossEntropy(), num_microbatches=plan.grad_accum, sharded_logits=True,
    )
    pipe = model.pipeline
    assert pipe is not None
    # as the worker builds them (dtk.worker.wiring): one per stage, ZeRO-1 over the replicas
    shard_group = mesh.dp_group if uses_zero1(cfg.scheme, mesh.degrees) else None
    reduces = zero1_reduces_gradients(cfg.scheme, mesh.degrees)
    opts = [build_optimizer(part.parameters(), optim=cfg.optim, shard_group=shard_group, reduces_gradients=reduces)
            for part in model.parts]
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.model.vocab_size, (plan.global_batch // plan.degrees.dp, cfg.model.seq_len + 1),
                         generator=g)  # this replica's share of the batch
    inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    dist.barrier()
    before = rss_mib()
    for _ in range(steps):
        losses: list = []
        args = (inputs,) if pipe.has_first_stage else ()
        kwargs = {"target": targets, "losses": losses} if pipe.has_last_stage else {}
        pipe.schedule.step(*args, **kwargs)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return peak, peak - before


def predicted_mib(cfg, plan) -> list[float]:
    """The planner's bytes of each rank that are tensors (params, grads, optimizer,
    activations, buffers: its total without the margin for fragmentation and the runtime,
    and without the checkpoint's staged copy, since no checkpoint is taken here), MiB."""
    import dataclasses

    from dtk.plan.cost.inputs import context
    from dtk.plan.cost.memory import rank_bytes
    from dtk.plan.cost.report import chosen_variant

    ctx = context(cfg, plan)
    job = dataclasses.replace(ctx.job(chosen_variant(ctx, plan)), async_checkpoint=False)
    out = []
    for r in range(plan.degrees.world):
        b = rank_bytes(ctx.shape, job, r)
        out.append((b.total - b.margin) / 2**20)
    return out


def measure(layout: str, num_micro: int, args: argparse.Namespace) -> dict[str, float]:
    """One layout (PPxTP, or PPxTPxDP for ZeRO-1 over DP replicas: +scheme=zero_tp_pp) at one
    count of micro-batches per step: the largest rank's figures."""
    import torch
    import torch.multiprocessing as mp

    from dtk.config.compose import compose
    from dtk.plan.plan import make_plan

    pp, tp, dp = ([int(x) for x in layout.split("x")] + [1])[:3]
    scheme = (["+scheme=zero_tp_pp", f"scheme.dp_replicate={dp}"] if dp > 1 else ["+scheme=hybrid", "scheme.dp_shard=1"])
    overrides = [
        f"model.num_layers={args.layers}", f"model.dim={args.dim}", "model.num_heads=4",
        f"model.seq_len={args.seq_len}", f"model.vocab_size={args.vocab}",
        f"train.global_batch={num_micro * args.micro_batch * dp}", f"train.micro_batch={args.micro_batch}",
        f"tasks_per_node={pp * tp * dp}", "optim.warmup_steps=0", *scheme,
        f"scheme.pp={pp}", f"scheme.tp={tp}", "scheme.pp_schedule=1f1b",
    ]
    cfg = compose(overrides)
    plan = make_plan(cfg, cwd="/tmp")
    assert plan.grad_accum == num_micro, (plan.grad_accum, num_micro)
    world = plan.degrees.world
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(rank_main, args=(world, folder, plan.to_json(), args.steps, args.tensors), nprocs=world,
                           start_method="spawn")
        results = [torch.load(f"{folder}/result_{r}.pt") for r in range(world)]
    got = {key: max(r[key] for r in results) for key in ("peak", "growth")}
    if args.tensors:
        budget = predicted_mib(cfg, plan)
        got["tensors"] = max(r["tensors"] for r in results)
        got["predicted"] = max(budget)
        got["worst"] = max((abs(p / r["tensors"] - 1), p / r["tensors"]) for p, r in zip(budget, results, strict=True))[1]
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["2x1", "2x2", "4x1", "4x2"],
                        help="PPxTP, or PPxTPxDP: ZeRO-1 over DP replicas (+scheme=zero_tp_pp)")
    parser.add_argument("--micro", nargs="+", type=int, default=[4, 16, 64], help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tensors", action="store_true",
                        help="also each rank's peak of live tensor bytes (torch.profiler's memory events)"
                             " against the planner's budget of it")
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's mmap threshold dynamic")
    args = parser.parse_args()
    if not args.glibc_default:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each spawned rank's malloc at its start
    logits_mib = args.micro_batch * args.seq_len * args.vocab * 4 / 2**20
    malloc = "glibc default" if args.glibc_default else "MALLOC_MMAP_THRESHOLD_=65536"
    print(f"one micro-batch's fp32 logits: {logits_mib:.1f} MiB (split over tp); steps {args.steps}; {malloc}")
    head = f"{'layout':<16}{'micro':>6}{'peak MiB':>10}{'growth MiB':>12}"
    print(head + (f"{'tensors MiB':>13}{'predicted':>11}{'ratio':>7}{'worst rank':>12}" if args.tensors else ""))
    for layout in args.layouts:
        got = {}
        for n in args.micro:
            got[n] = g = measure(layout, n, args)
            line = f"{layout:<16}{n:>6}{g['peak']:>10.0f}{g['growth']:>12.0f}"
            if args.tensors:
                line += f"{g['tensors']:>13.1f}{g['predicted']:>11.1f}{g['predicted'] / g['tensors']:>7.3f}{g['worst']:>12.3f}"
            print(line, flush=True)
        if len(args.micro) >= 2:
            a, b = sorted(args.micro)[-2:]
            ratio = got[b]["peak"] / got[a]["peak"]
            growth = got[b]["growth"] / max(got[a]["growth"], 1e-9)
            print(f"{layout}: peak {b}/{a} micro-batches = {ratio:.3f} ({'<' if ratio < 1.05 else '>='} 1.05),"
                  f" growth {growth:.2f}x", flush=True)


if __name__ == "__main__":
    main()
