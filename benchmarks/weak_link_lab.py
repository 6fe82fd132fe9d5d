"""Step time on a slow link between two lab nodes: DiLoCo and the compressions against DDP.

Each mode is a real job on the lab cluster (`python -m dtk.submit cluster=lab nodes=2
tasks_per_node=1`, one gloo worker per node), the built-in model widened to a few million
parameters (default model.dim=256 model.num_layers=4: 3.3M), a small global batch so the
exchange, not the compute, is most of an every-step DDP step. Bring the lab up with its
nodes in network namespaces and throttle what each node sends first:

    python -m dtk.lab up --nodes 2 --netns
    python -m dtk.lab slow node1 50mbit
    python -m dtk.lab slow node2 50mbit
    python benchmarks/weak_link_lab.py --repeats 3

  ddp       +scheme=ddp: gradients all-reduced every step (the reference)
  diloco    +sync=diloco sync.every=H: the replicas synchronize every H steps
  bf16      scheme.grad_compression=bf16: the every-step all-reduce in bfloat16
  powersgd  scheme.grad_compression=powersgd: PowerSGD (scheme.powersgd_rank) after 10 plain steps

The modes run one after the other, interleaved (ddp, diloco, bf16, powersgd, ddp, ...), so a
change in the machine's load falls on every mode. Per run it reads metrics.jsonl over the
steps after --skip (the start-up and PowerSGD's 10 plain steps left out): the median and the
mean step_time_s (the mean counts DiLoCo's synchronizing step once per H steps, the median
does not see it), and idle_share weighted by each step's time (the idle share of the steps'
summed time, as `python -m dtk.report` counts it). Per mode it prints the median over the repeats
of each, and each as a ratio to DDP's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dtk.common.rundir import RunDir  # noqa: E402

LAB = ["cluster=lab", "nodes=2", "tasks_per_node=1"]


def modes(every: int) -> dict[str, list[str]]:
    return {
        "ddp": ["+scheme=ddp"],
        "diloco": ["+sync=diloco", f"sync.every={every}"],
        "bf16": ["+scheme=ddp", "scheme.grad_compression=bf16"],
        "powersgd": ["+scheme=ddp", "scheme.grad_compression=powersgd"],
    }


def wait_for(job: str, *, timeout_s: float) -> None:
    """Until Slurm no longer lists the job (the lab keeps a finished one a minute: COMPLETED)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()
        if out in ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return
        time.sleep(2)
    raise SystemExit(f"job {job} still running after {timeout_s:.0f} s")


def run(name: str, overrides: list[str], *, root: Path, steps: int, skip: int, model: list[str],
        timeout_s: float) -> dict[str, float]:
    """One lab job; its median and mean step time and its idle share over the steps after `skip`.
    A run directory that already holds the last step's metrics (--root of an earlier call) is read again."""
    if steps not in RunDir(root / name).latest_metrics():
        submit(name, overrides, root=root, steps=steps, model=model, timeout_s=timeout_s)
    return figures(root / name, steps=steps, skip=skip)


def submit(name: str, overrides: list[str], *, root: Path, steps: int, model: list[str], timeout_s: float) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dtk.submit", *LAB, *overrides, *model, f"train.steps={steps}",
         "checkpoint.every=0", "train.log_every=4", "train.system_every_s=0", f"run.name={name}",
         f"run.root={root}"],
        cwd=REPO, capture_output=True, text=True,
    )
    found = re.search(r"submitted job (\d+)", proc.stdout)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{name}: submit failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    wait_for(found.group(1), timeout_s=timeout_s)


def figures(run_dir: Path, *, steps: int, skip: int) -> dict[str, float]:
    records = RunDir(run_dir).latest_metrics() if run_dir.is_dir() else {}
    window = [records[s] for s in range(skip + 1, steps + 1) if s in records]
    if len(window) != steps - skip:
        raise SystemExit(f"{run_dir}: {len(window)} of the steps {skip + 1}-{steps} in its metrics")
    times = [r["step_time_s"] for r in window]
    idle = sum(r["idle_share"] * r["step_time_s"] for r in window) / sum(times)  # a share of the time, as dtk.report's
    return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times), "idle_share": idle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--skip", type=int, default=16, help="steps left out at the start (> 10 for PowerSGD)")
    parser.add_argument("--every", type=int, default=16, help="H of diloco")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", nargs="*", default=["model.dim=256", "model.num_layers=4", "train.global_batch=16"],
                        help="overrides of the model and batch, the same for every mode")
    parser.add_argument("--modes", nargs="+", help="these modes only (ddp, the reference, always runs)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one job may take")
    parser.add_argument("--root", type=Path, help="the runs' folder (default: a new temporary one); runs it"
                        " already holds to the last step are read again, not run")
    parser.add_argument("--json", type=Path, help="write the figures here (after every run)")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="dtk-weak-link-lab-"))
    chosen = {n: o for n, o in modes(args.every).items() if not args.modes or n == "ddp" or n in args.modes}
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in chosen}
    for rep in range(args.repeats):
        for name, overrides in chosen.items():
            fig = run(f"{name}-{rep}", overrides, root=root, steps=args.steps, skip=args.skip, model=args.model,
                      timeout_s=args.timeout)
            runs[name].append(fig)
            print(f"repeat {rep} {name:<9} median {fig['median_s']:.3f} s  mean {fig['mean_s']:.3f} s"
                  f"  idle {100 * fig['idle_share']:.1f}%", flush=True)
            if args.json:
                args.json.write_text(json.dumps({"root": str(root), "runs": runs}, indent=2))
    table = {n: {k: statistics.median(r[k] for r in rs) for k in ("median_s", "mean_s", "idle_share")}
             for n, rs in runs.items()}
    ref = table["ddp"]
    print(f"{args.steps} steps (steps {args.skip + 1}-{args.steps} timed), {args.repeats} repeats, H={args.every},"
          f" {' '.join(args.model)}; runs in {root}")
    print(f"{'mode':<9} {'median s':>9} {'/ ddp':>6} {'mean s':>8} {'/ ddp':>6} {'idle':>6}")
    for name, t in table.items():
        print(f"{name:<9} {t['median_s']:>9.3f} {t['median_s'] / ref['median_s']:>6.3f} {t['mean_s']:>8.3f}"
              f" {t['mean_s'] / ref['mean_s']:>6.3f} {100 * t['idle_share']:>5.1f}%")
    if args.json:
        args.json.write_text(json.dumps({"root": str(root), "runs": runs, "table": table}, indent=2))


if __name__ == "__main__":
    main()
