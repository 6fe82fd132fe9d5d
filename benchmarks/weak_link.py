"""Loss of the ways to exchange less between replicas, against every-step DDP.

Each mode is a real run of the built-in model (`python -m dtk.submit`, 2 local CPU workers,
gloo, the default data, optimizer and global batch) for --steps steps; all runs see the same
samples in the same order. Per mode it prints the final step's loss, the mean loss of the
last 10 steps (less noisy than one batch), and both as a ratio to every-step DDP's:

  ddp        +scheme=ddp: gradients all-reduced every step (the reference)
  local_sgd  +sync=local_sgd sync.every=H: parameters averaged every H steps
  diloco     +sync=diloco sync.every=H: outer Nesterov SGD (lr 0.7, momentum 0.9) every H steps
  diloco_bf16  the same, the deltas all-reduced in bfloat16 (sync.dtype=bfloat16)
  diloco_fragments  the same, streaming: 4 fragments synchronized in turn, H/4 steps apart
  bf16       scheme.grad_compression=bf16: the every-step all-reduce in bfloat16
  powersgd   scheme.grad_compression=powersgd: rank-`--rank` PowerSGD after 10 plain steps

    python benchmarks/weak_link.py --steps 160 --every 8
    python benchmarks/weak_link.py --steps 160 --modes powersgd --rank 8
    python benchmarks/weak_link.py --steps 160 --modes diloco_bf16
    python benchmarks/weak_link.py --steps 160 --modes diloco diloco_fragments

Speed is not measured here: on one machine the workers talk over loopback, where the
exchange costs next to nothing. What a slow link costs is the lab's figure (docs/benchmarks.md).

--diagnose: why PowerSGD loses loss on this model. Not through dtk.submit but the same
parts in this process's 2 gloo ranks (the built-in model, the synthetic data, dtk's AdamW
and its warm-up/cosine schedule, DDP, gradient clipping at 1.0) with torch's powerSGD_hook
under settings dtk does not expose: the step compression starts (torch's
start_powerSGD_iter), error feedback on or off, clipping on or off, and plain SGD with
momentum in place of AdamW. Each line is the mean loss of the last 10 steps, and its ratio
to the same optimizer's uncompressed run.

    python benchmarks/weak_link.py --steps 120 --diagnose
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dtk.common.rundir import RunDir  # noqa: E402


def modes(every: int, rank: int) -> dict[str, list[str]]:
    return {
        "ddp": ["+scheme=ddp"],
        "local_sgd": ["+sync=local_sgd", f"sync.every={every}"],
        "diloco": ["+sync=diloco", f"sync.every={every}"],
        "diloco_bf16": ["+sync=diloco", f"sync.every={every}", "sync.dtype=bfloat16"],
        "diloco_fragments": ["+sync=diloco", f"sync.every={every}", "sync.fragments=4"],
        "bf16": ["+scheme=ddp", "scheme.grad_compression=bf16"],
        "powersgd": ["+scheme=ddp", "scheme.grad_compression=powersgd", f"scheme.powersgd_rank={rank}"],
    }


def run(name: str, overrides: list[str], *, root: Path, steps: int) -> tuple[dict[int, float], float]:
    """One run; its loss per step and its wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dtk.submit", *overrides, "tasks_per_node=2", f"train.steps={steps}",
         "checkpoint.every=0", "train.log_every=20", "train.system_every_s=0", f"run.name={name}",
         f"run.root={root}"],
        cwd=root, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    records = RunDir(root / name).latest_metrics()
    return {step: rec["loss"] for step, rec in records.items()}, time.perf_counter() - t0


DIAGNOSE = {  # name -> (optimizer, PowerSGD rank (0: none), start step, error feedback, clip)
    "adamw ddp": ("adamw", 0, 0, True, 1.0),
    "adamw powersgd r2 start 10": ("adamw", 2, 10, True, 1.0),
    "adamw powersgd r2 start 10, no error feedback": ("adamw", 2, 10, False, 1.0),
    "adamw powersgd r2 start 10, no clipping": ("adamw", 2, 10, True, 0.0),
    "adamw powersgd r2 start 20 (end of lr warm-up)": ("adamw", 2, 20, True, 1.0),
    "adamw powersgd r8 start 20": ("adamw", 8, 20, True, 1.0),
    "adamw powersgd r2 start 60": ("adamw", 2, 60, True, 1.0),
    "sgd ddp": ("sgd", 0, 0, True, 1.0),
    "sgd powersgd r2 start 10": ("sgd", 2, 10, True, 1.0),
}


def _diagnose_rank(rank: int, steps: int, variant: tuple, folder: str) -> None:
    """One rank of one --diagnose run; rank 0 writes the mean global loss of each step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    from dtk.config.compose import compose
    from dtk.data.loader import build_splits
    from dtk.models.transformer import build
    from dtk.train.optim import build_optimizer, build_scheduler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    name, r, start, feedback, clip = variant
    cfg = compose([])
    data, _ = build_splits(cfg.data, model=cfg.model)
    torch.manual_seed(0)
    model = DistributedDataParallel(build())
    if r:
        model.register_comm_hook(powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                                        start_powerSGD_iter=start, use_error_feedback=feedback,
                                                        random_seed=0), powersgd.powerSGD_hook)
    if name == "adamw":
        opt = build_optimizer(model.parameters(), optim=cfg.optim)
        sched = build_scheduler(opt, optim=cfg.optim, total_steps=steps)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        sched = build_scheduler(opt, optim=cfg.optim, total_steps=steps)
    order = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        rows = torch.randint(0, len(data), (cfg.train.global_batch,), generator=order)
        batch = torch.as_tensor(data.get(rows.chunk(2)[rank].numpy())).long()
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / 2)
    if rank == 0:
        Path(folder, "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


def diagnose(steps: int) -> None:
    import torch.multiprocessing as mp

    results = {}
    for label, variant in DIAGNOSE.items():
        folder = tempfile.mkdtemp(prefix="dtk-powersgd-")
        mp.start_processes(_diagnose_rank, args=(steps, variant, folder), nprocs=2, start_method="spawn")
        losses = json.loads(Path(folder, "losses.json").read_text())
        results[label] = statistics.mean(losses[-10:])
        ref = results[f"{variant[0]} ddp"]
        print(f"{label:<48} last 10 {results[label]:.4f}  / uncompressed {results[label] / ref:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--every", type=int, default=8, help="H of local_sgd and diloco")
    parser.add_argument("--rank", type=int, default=2, help="scheme.powersgd_rank")
    parser.add_argument("--modes", nargs="+", help="these modes only (ddp, the reference, always runs)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--diagnose", action="store_true", help="PowerSGD's loss under settings dtk does not expose")
    args = parser.parse_args()
    if args.diagnose:
        return diagnose(args.steps)
    root = Path(tempfile.mkdtemp(prefix="dtk-weak-link-"))
    results = {}
    for name, overrides in modes(args.every, args.rank).items():
        if args.modes and name != "ddp" and name not in args.modes:
            continue
        losses, seconds = run(name, overrides, root=root, steps=args.steps)
        last = [losses[s] for s in range(args.steps - 9, args.steps + 1)]
        results[name] = {"final": losses[args.steps], "last10": statistics.mean(last), "seconds": round(seconds, 1)}
    ref = results["ddp"]
    print(f"{args.steps} steps, 2 CPU workers, H={args.every}, powersgd rank {args.rank}")
    print(f"{'mode':<11} {'final loss':>10} {'/ ddp':>7} {'last 10':>9} {'/ ddp':>7} {'wall s':>7}")
    for name, r in results.items():
        r["final_ratio"] = r["final"] / ref["final"]
        r["last10_ratio"] = r["last10"] / ref["last10"]
        print(f"{name:<11} {r['final']:>10.4f} {r['final_ratio']:>7.3f} {r['last10']:>9.4f} {r['last10_ratio']:>7.3f}"
              f" {r['seconds']:>7.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
