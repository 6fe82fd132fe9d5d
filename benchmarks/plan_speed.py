"""How long `python -m dtk.plan` takes on the login node for the built-in model, and that it
imports no torch: the whole command (interpreter start, compose, plan, the memory budget of
every scheme, the search for the smallest node count that fits and the searched
recommendation with its step times), run as a user runs it.

For each job: the median over --repeats runs of the wall time and of the CPU time the
command used (user + system, from the children's rusage), and whether torch was imported
(`-X importtime`). The machine is shared: CPU time is the figure that does not depend on
the load; the load average is printed with it.

    python benchmarks/plan_speed.py --repeats 7
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOBS = {
    "default (2 workers, ddp)": [],
    "fsdp, 8 nodes x 8 GPUs, h100-80gb": ["cluster=slurm", "nodes=8", "cluster.accelerator=h100-80gb", "+scheme=fsdp"],
    "ZeRO paper what-if, 64 devices": ["cluster=slurm", "nodes=8", "cluster.accelerator=a100-80gb", "plan.params=7.5e9",
                                       "plan.param_bytes=2", "plan.grad_bytes=2", "plan.optimizer_bytes=12"],
    "70B what-if, 2 nodes x 8 h100-80gb": ["cluster=slurm", "nodes=2", "cluster.accelerator=h100-80gb", "plan.params=70e9",
                                           "plan.layers=80", "plan.hidden=8192", "plan.heads=64", "plan.seq_len=4096"],
}


def one(args: list[str], cwd: str) -> tuple[float, float, bool]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dtk.plan", *args, "--json"], cwd=cwd,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"dtk.plan {' '.join(args)} failed: {proc.stderr[-500:]}")
    imported = {ln.split("|")[-1].strip() for ln in proc.stderr.splitlines() if "|" in ln}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, "torch" in imported


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
    print(f"{'job':<36} {'wall s (median)':>16} {'cpu s (median)':>15} {'torch imported':>15}")
    with tempfile.TemporaryDirectory() as cwd:
        for name, job in JOBS.items():
            runs = [one(job, cwd) for _ in range(args.repeats)]
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            print(f"{name:<36} {wall:>16.2f} {cpu:>15.2f} {str(any(r[2] for r in runs)):>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
