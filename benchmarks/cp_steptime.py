"""Step time under context parallelism (scheme.cp) on the CPU, measured against the plan.

For each cp: a real run (`python -m dtk.submit`, local cluster, one intra-op thread per
worker) of the built-in transformer on one long sample per step, cp=1 as one process and
cp=N as N gloo workers of `+scheme=cp` (each holds seq_len / cp tokens), and the median
step_time_s of metrics.jsonl over the steps after the warm-up. The plan of the same job is
`python -m dtk.plan`'s predicted step, asked as if the device were a GPU whose speeds are
this machine's, measured first:

- the matmul rate of one thread at each GEMM width (`python -m dtk.bench matmul`, under
  `taskset` to one core) as `cluster.matmul_rates`, and `cluster.peak_tflops` = the widest
  width's rate / the generic efficiency (0.4), so the planner's sustained rate at a width is
  the rate measured at it;
- the links `python -m dtk.doctor tasks_per_node=2` measured (gloo all-reduce), as
  `plan.doctor`.

    python benchmarks/cp_steptime.py [--cps 1 2] [--seq-len 4096] [--steps 12] [--repeats 3]

Prints a markdown table (and --json FILE the figures). The workers of each run share the
machine's cores; cp above the number of cores oversubscribes them (the plan does not know).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dtk.common.rundir import RunDir

GENERIC_EFFICIENCY = 0.4  # dtk.plan.accelerators.GENERIC.efficiency: the planner's share of a peak


def sh(*args: str, cwd: Path) -> str:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def job(args: argparse.Namespace, cp: int) -> list[str]:
    model = [f"model.seq_len={args.seq_len}", f"model.dim={args.dim}", f"model.num_layers={args.layers}",
             f"model.num_heads={args.heads}", f"model.vocab_size={args.vocab}", "train.global_batch=1"]
    layout = ["tasks_per_node=1", "+scheme=fsdp"] if cp == 1 else \
        [f"tasks_per_node={cp}", "+scheme=cp", f"scheme.cp={cp}", "scheme.dp_shard=1"]
    return [*model, *layout]


def measured_step(args: argparse.Namespace, cp: int, root: Path, name: str) -> dict[str, float]:
    sh(sys.executable, "-m", "dtk.submit", *job(args, cp), f"train.steps={args.steps}", "train.threads=1",
       "train.log_every=1", "train.eval_every=0", "checkpoint.every=0", f"run.root={root}", f"run.name={name}",
       cwd=root)
    records = [json.loads(line) for line in RunDir(root / name).metrics.read_text().splitlines()]
    timed = [r for r in records if r["step"] > args.warmup]
    phases = {k: statistics.median(r["phases"][k] for r in timed) for k in timed[0]["phases"]}
    return {"step_s": statistics.median(r["step_time_s"] for r in timed), **phases}


def planned_step(args: argparse.Namespace, cp: int, root: Path, speeds: list[str]) -> dict[str, float]:
    out = sh(sys.executable, "-m", "dtk.plan", *job(args, cp), *speeds, "--json", cwd=root)
    return json.loads(out)["predicted"]


def calibrate(root: Path) -> tuple[list[str], dict[str, object]]:
    """The planner's overrides that make its GPU this machine (module doc), and what was measured."""
    rates = root / "matmul"
    sh("taskset", "-c", "0", sys.executable, "-m", "dtk.bench", "matmul", "--out", str(rates), cwd=root)
    measured = json.loads(next(rates.glob("matmul-*.json")).read_text())
    widest = measured["rows"][-1]["tflops"]
    sh(sys.executable, "-m", "dtk.doctor", "tasks_per_node=2", "doctor.max_mb_cpu=16", "doctor.repeats=3", cwd=root)
    doctor = sorted((root / "runs").glob("doctor-*"))[-1]
    speeds = ["dist.device=cuda", f"cluster.peak_tflops={widest / GENERIC_EFFICIENCY:.6g}",
              f"cluster.matmul_rates={rates}", f"plan.doctor={doctor}"]
    return speeds, {"matmul": measured["rows"], "doctor": str(doctor)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--repeats", type=int, default=3, help="runs per cp, interleaved; the median of their medians")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dtk-cp-steptime-"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    speeds, calibration = calibrate(root)
    runs: dict[int, list[dict[str, float]]] = {cp: [] for cp in args.cps}
    for repeat in range(args.repeats):
        for cp in args.cps:
            runs[cp].append(measured_step(args, cp, root, f"cp{cp}-{repeat}"))
    rows = []
    for cp in args.cps:
        plan = planned_step(args, cp, root, speeds)
        measured = {k: statistics.median(r[k] for r in runs[cp]) for k in runs[cp][0]}
        rows.append({"cp": cp, "measured": measured, "each": [r["step_s"] for r in runs[cp]], "plan": plan})
    base = rows[0]
    print(f"seq_len {args.seq_len}, dim {args.dim}, {args.layers} layers, {args.heads} heads, one sample per step;"
          f" matmul {calibration['matmul']}; links {calibration['doctor']}\n")
    print("| cp | tokens per rank | measured step s (runs) | vs first | comm phase s | planned step s (compute + cp exchange) |"
          " vs first | measured / planned |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        m, pl = r["measured"], r["plan"]
        exposed = pl["exposed_by_axis"]
        cp_s = exposed["cp"] if "cp" in exposed else 0.0  # no cp axis at cp=1
        print(f"| {r['cp']} | {args.seq_len // r['cp']} | {m['step_s']:.3f} ({', '.join(f'{x:.3f}' for x in r['each'])})"
              f" | {m['step_s'] / base['measured']['step_s']:.3f} | {m['comm']:.3f}"
              f" | {pl['predicted_step_s']:.3f} ({pl['compute_s']:.3f} + {cp_s:.3f})"
              f" | {pl['predicted_step_s'] / base['plan']['predicted_step_s']:.3f}"
              f" | {m['step_s'] / pl['predicted_step_s']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "calibration": calibration,
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
