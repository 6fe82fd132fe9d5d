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

The ranks run with MALLOC_MMAP_THRESHOLD_=65536 (unless --glibc-default): every large
tensor is then its own mapping, returned to the system when freed, so the resident set
follows the tensors alive. With glibc's default, a freed large block raises the threshold
and later blocks of that size come from the heap, where tensors of different lifetimes
interleave and the heap grows by fragmentation: the resident set then grows with the
micro-batches even when the tensors alive do not (measured: docs/benchmarks.md).

    python benchmarks/pipeline_memory.py
    python benchmarks/pipeline_memory.py --layouts 2x1 4x2 --micro 4 16 64 --steps 2
    python benchmarks/pipeline_memory.py --layouts 2x1 --micro 4 16 64 --glibc-default
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


def rank_main(rank: int, world: int, folder: str, plan_json: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    from dtk.dist.mesh import build_mesh
    from dtk.models.build import ParallelSpec, build_model, materialize
    from dtk.parallel.parallelize import parallelize
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
    opt = build_optimizer([p for part in model.parts for p in part.parameters()], optim=cfg.optim, shard_group=None)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.model.vocab_size, (plan.global_batch, cfg.model.seq_len + 1), generator=g)
    inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    dist.barrier()
    before = rss_mib()
    for _ in range(steps):
        losses: list = []
        args = (inputs,) if pipe.has_first_stage else ()
        kwargs = {"target": targets, "losses": losses} if pipe.has_last_stage else {}
        pipe.schedule.step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    torch.save({"peak": peak, "growth": peak - before}, f"{folder}/result_{rank}.pt")
    dist.destroy_process_group()


def measure(pp: int, tp: int, num_micro: int, args: argparse.Namespace) -> dict[str, float]:
    import torch
    import torch.multiprocessing as mp

    from dtk.config.compose import compose
    from dtk.plan.plan import make_plan

    overrides = [
        f"model.num_layers={args.layers}", f"model.dim={args.dim}", "model.num_heads=4",
        f"model.seq_len={args.seq_len}", f"model.vocab_size={args.vocab}",
        f"train.global_batch={num_micro * args.micro_batch}", f"train.micro_batch={args.micro_batch}",
        f"tasks_per_node={pp * tp}", "optim.warmup_steps=0", "+scheme=hybrid", "scheme.dp_shard=1",
        f"scheme.pp={pp}", f"scheme.tp={tp}", "scheme.pp_schedule=1f1b",
    ]
    plan = make_plan(compose(overrides), cwd="/tmp")
    assert plan.grad_accum == num_micro, (plan.grad_accum, num_micro)
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(rank_main, args=(pp * tp, folder, plan.to_json(), args.steps), nprocs=pp * tp,
                           start_method="spawn")
        results = [torch.load(f"{folder}/result_{r}.pt") for r in range(pp * tp)]
    return {key: max(r[key] for r in results) for key in ("peak", "growth")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["2x1", "2x2", "4x1", "4x2"], help="PPxTP")
    parser.add_argument("--micro", nargs="+", type=int, default=[4, 16, 64], help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's mmap threshold dynamic")
    args = parser.parse_args()
    if not args.glibc_default:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each spawned rank's malloc at its start
    logits_mib = args.micro_batch * args.seq_len * args.vocab * 4 / 2**20
    malloc = "glibc default" if args.glibc_default else "MALLOC_MMAP_THRESHOLD_=65536"
    print(f"one micro-batch's fp32 logits: {logits_mib:.1f} MiB (split over tp); steps {args.steps}; {malloc}")
    print(f"{'layout':<10}{'micro':>6}{'peak MiB':>10}{'growth MiB':>12}")
    for layout in args.layouts:
        pp, tp = (int(x) for x in layout.split("x"))
        got = {}
        for n in args.micro:
            got[n] = measure(pp, tp, n, args)
            print(f"pp={pp} tp={tp:<3}{n:>6}{got[n]['peak']:>10.0f}{got[n]['growth']:>12.0f}", flush=True)
        if len(args.micro) >= 2:
            a, b = sorted(args.micro)[-2:]
            ratio = got[b]["peak"] / got[a]["peak"]
            growth = got[b]["growth"] / max(got[a]["growth"], 1e-9)
            print(f"pp={pp} tp={tp}: peak {b}/{a} micro-batches = {ratio:.3f} ({'<' if ratio < 1.05 else '>='} 1.05),"
                  f" growth {growth:.2f}x", flush=True)


if __name__ == "__main__":
    main()
