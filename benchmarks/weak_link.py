"""Loss of the ways to exchange less between replicas, against every-step DDP.

Each mode is a real run of the built-in model (`python -m dtk.submit`, 2 local CPU workers,
gloo, the default data, optimizer and global batch) for --steps steps; all runs see the same
samples in the same order. Per mode it prints the final step's loss, the mean loss of the
last 10 steps (less noisy than one batch), and both as a ratio to every-step DDP's:

  ddp        +scheme=ddp: gradients all-reduced every step (the reference)
  local_sgd  +sync=local_sgd sync.every=H: parameters averaged every H steps
  diloco     +sync=diloco sync.every=H: outer Nesterov SGD (lr 0.7, momentum 0.9) every H steps
  diloco_bf16  the same, the deltas all-reduced in bfloat16 (sync.dtype=bfloat16)
  bf16       scheme.grad_compression=bf16: the every-step all-reduce in bfloat16
  powersgd   scheme.grad_compression=powersgd: rank-`--rank` PowerSGD after 10 plain steps

    python benchmarks/weak_link.py --steps 160 --every 8
    python benchmarks/weak_link.py --steps 160 --modes powersgd --rank 8
    python benchmarks/weak_link.py --steps 160 --modes diloco_bf16

Speed is not measured here: on one machine the workers talk over loopback, where the
exchange costs next to nothing. What a slow link costs is the lab's figure (docs/benchmarks.md).
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

from dtk.rundir import RunDir  # noqa: E402


def modes(every: int, rank: int) -> dict[str, list[str]]:
    return {
        "ddp": ["+scheme=ddp"],
        "local_sgd": ["+sync=local_sgd", f"sync.every={every}"],
        "diloco": ["+sync=diloco", f"sync.every={every}"],
        "diloco_bf16": ["+sync=diloco", f"sync.every={every}", "sync.dtype=bfloat16"],
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--every", type=int, default=8, help="H of local_sgd and diloco")
    parser.add_argument("--rank", type=int, default=2, help="scheme.powersgd_rank")
    parser.add_argument("--modes", nargs="+", help="these modes only (ddp, the reference, always runs)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
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
