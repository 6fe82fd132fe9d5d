"""python -m dtk.bench scaling [overrides] nodes=1,2,4   (or tasks_per_node=1,2,4 on one machine)
python -m dtk.bench matmul [--out DIR]                  (this machine's matmul rate, dtk/bench/matmul.py)

The same recipe at several sizes with the same global batch: how much a step speeds up as
the job grows, and which part of the step stops it. Each size is a real run, submitted as
`python -m dtk.submit` would be (on any cluster config, waiting for it to end) into its own
run directory; the figures come from those directories, measured the same way at every
size. No torch here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dtk.common.errors import ArgumentParser, UserError, run_cli
from dtk.common.rundir import IDLE_PHASES, PHASES
from dtk.report.runs import RunData, load_run

AXES = ("nodes", "tasks_per_node")
WARMUP_SHARE = 0.2  # the first steps (compile, allocator, caches) are left out of the medians

EPILOG = """examples:
  python -m dtk.bench scaling tasks_per_node=1,2 train.steps=40        # this machine, 1 and 2 workers
  python -m dtk.bench scaling cluster=lab nodes=1,2 tasks_per_node=1   # the lab cluster
  python -m dtk.bench scaling cluster=mysite +scheme=fsdp nodes=1,2,4,8 train.steps=200
  srun -N4 --ntasks-per-node=1 python -m dtk.bench matmul --out /shared/matmul   # each node's matmul rate

Prints, per size: median step time, speedup and efficiency against the smallest size,
idle share and its parts (data, comm, checkpoint, straggler), and names the phase whose
time grows most beyond what perfect scaling allows. Writes scaling.png and scaling.json
to --out (default: RUN_ROOT/scaling-<time>/). Runs go to RUN_ROOT/scaling-<time>-<axis><size>.
"""


def parse_sizes(overrides: list[str]) -> tuple[str, list[int], list[str]]:
    """The swept axis, its sizes, and the other overrides."""
    swept = [o for o in overrides if o.split("=", 1)[0] in AXES and "," in o]
    if len(swept) != 1:
        raise UserError(
            f"scaling needs exactly one of {' or '.join(AXES)} with several sizes, e.g. nodes=1,2,4;"
            f" got {' '.join(swept) or 'none'}"
        )
    axis, values = swept[0].split("=", 1)
    try:
        sizes = [int(v) for v in values.split(",")]
    except ValueError:
        raise UserError(f"{axis}={values}: expected whole numbers separated by commas, e.g. {axis}=1,2,4") from None
    if len(set(sizes)) != len(sizes) or any(s < 1 for s in sizes):
        raise UserError(f"{axis}={values}: expected distinct sizes of 1 or more, e.g. {axis}=1,2,4")
    rest = [o for o in overrides if o is not swept[0]]
    if any(o.startswith("run.name=") for o in rest):
        raise UserError("run.name: the benchmark names each size's run itself; leave run.name unset")
    return axis, sorted(sizes), rest


def measure(run: RunData) -> dict[str, Any]:
    """Median step time and mean phase seconds after the warm-up steps of one run."""
    records = [r for _, r in sorted(run.latest.items())]
    records = records[int(len(records) * WARMUP_SHARE):] or records
    if not records:
        raise UserError(f"{run.path}: the run logged no step; see its logs/ folder")
    out: dict[str, Any] = {
        "world_size": records[-1].get("world_size"),
        "step_time_s": statistics.median(float(r["step_time_s"]) for r in records),
        "steps": len(records),
    }
    profiled = [r for r in records if r.get("phases")]
    if profiled:
        out["phases"] = {p: statistics.fmean(float(r["phases"].get(p) or 0.0) for r in profiled) for p in PHASES}
        out["idle_share"] = statistics.fmean(float(r.get("idle_share") or 0.0) for r in profiled)
    return out


def analyse(axis: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Speedup and efficiency against the smallest size; the phase that stops scaling."""
    base = rows[0]
    for r in rows:
        r["speedup"] = base["step_time_s"] / r["step_time_s"]
        r["efficiency"] = r["speedup"] / (r["size"] / base["size"])
    out: dict[str, Any] = {"axis": axis, "rows": rows, "limit": None}
    last = rows[-1]
    if len(rows) > 1 and "phases" in base and "phases" in last:
        # Perfect scaling divides every phase by the growth factor; the phase with the most
        # seconds left over at the largest size is what stops the step from scaling.
        growth = last["size"] / base["size"]
        excess = {p: last["phases"][p] - base["phases"][p] / growth for p in PHASES}
        phase = max(excess, key=lambda p: excess[p])
        lost = last["step_time_s"] - base["step_time_s"] / growth
        out["limit"] = {"phase": phase, "excess_s": excess[phase], "lost_s": lost, "excess": excess}
    return out


def render(result: dict[str, Any]) -> str:
    axis = result["axis"]
    head = f"{axis:>14} {'world':>5} {'step':>10} {'speedup':>8} {'effic.':>7} {'idle':>6} " + " ".join(
        f"{p:>10}" for p in IDLE_PHASES)
    lines = [head]
    for r in result["rows"]:
        ph = r.get("phases")
        idle = f"{100 * r['idle_share']:5.1f}%" if "idle_share" in r else f"{'-':>6}"
        parts = " ".join(f"{1000 * ph[p]:8.1f}ms" if ph else f"{'-':>10}" for p in IDLE_PHASES)
        lines.append(f"{r['size']:>14} {r['world_size']:>5} {1000 * r['step_time_s']:8.1f}ms {r['speedup']:7.2f}x"
                     f" {100 * r['efficiency']:6.1f}% {idle} {parts}")
    limit = result.get("limit")
    if limit:
        lines.append(f"stops scaling: {limit['phase']} ({1000 * limit['excess_s']:.1f} ms per step beyond perfect"
                     f" scaling at {axis}={result['rows'][-1]['size']}; the whole step is"
                     f" {1000 * limit['lost_s']:.1f} ms beyond it)")
    elif len(result["rows"]) > 1:
        lines.append("stops scaling: unknown (the runs have no phase timings: train.profile=false?)")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    from dtk.report.plots import _figure, save

    fig = _figure(10.0, 4.2)
    rows = result["rows"]
    sizes = [r["size"] for r in rows]
    ax = fig.add_subplot(1, 2, 1)
    ax.plot(sizes, [r["speedup"] for r in rows], marker="o", label="measured")
    ax.plot(sizes, [s / sizes[0] for s in sizes], linestyle="--", color="grey", label="perfect")
    ax.set_xlabel(result["axis"])
    ax.set_ylabel("speedup of the step")
    ax.set_title("scaling at the same global batch")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    ax2 = fig.add_subplot(1, 2, 2)
    labels = [str(s) for s in sizes]
    if all("phases" in r for r in rows):
        bottom = [0.0] * len(rows)
        for p in PHASES:
            vals = [1000 * r["phases"][p] for r in rows]
            ax2.bar(labels, vals, bottom=bottom, label=p)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax2.legend(fontsize="small", ncol=2)
    else:
        ax2.bar(labels, [1000 * r["step_time_s"] for r in rows], label="step time")
    ax2.set_xlabel(result["axis"])
    ax2.set_ylabel("ms per step")
    ax2.set_title("step time by phase")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    return save(fig, path, l1 + l2)


def run_size(axis: str, size: int, overrides: list[str], name: str) -> RunData:
    cmd = [sys.executable, "-m", "dtk.submit", *overrides, f"{axis}={size}", f"run.name={name}", "submit.wait=true"]
    print(f"bench: {axis}={size}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{axis}={size}: the run failed ({said.removeprefix('error: ')})")
    run_dir = next((line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("run ")), None)
    if run_dir is None:
        raise UserError(f"{axis}={size}: could not tell the run directory from the submit output")
    return load_run(Path(run_dir))


def scaling(overrides: list[str], out: Path | None) -> dict[str, Any]:
    axis, sizes, rest = parse_sizes(overrides)
    root = next((o.split("=", 1)[1] for o in rest if o.startswith("run.root=")), "runs")
    stamp = time.strftime("scaling-%Y%m%d-%H%M%S")
    rows = []
    for size in sizes:
        run = run_size(axis, size, rest, f"{stamp}-{axis.replace('_', '-')}{size}")
        rows.append({"size": size, "run_dir": str(run.path), **measure(run)})
    result = analyse(axis, rows)
    folder = out or Path(root) / stamp
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scaling.json").write_text(json.dumps(result, indent=2) + "\n")
    result["plot"] = str(plot(result, folder / "scaling.png"))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m dtk.bench", description="Benchmarks of a recipe on a cluster.", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("scaling", help="the same recipe at several sizes: speedup, efficiency, idle share")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="as for dtk.submit; one of nodes= or tasks_per_node= lists sizes")
    s.add_argument("--out", type=Path, help="where scaling.png and scaling.json go")
    m = sub.add_parser("matmul", help="this machine's matmul rate at each GEMM width, for the planner (cluster.matmul_rates)")
    m.add_argument("--out", type=Path, default=Path("matmul"),
                   help="the folder matmul-HOST.json goes into (default: ./matmul); run it on each node")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "matmul":
        from dtk.bench import matmul as bench_matmul

        measured = bench_matmul.measure()
        print(bench_matmul.render(measured))
        print(f"wrote {bench_matmul.write(measured, args.out)}; plan with cluster.matmul_rates={args.out}")
        return 0
    result = scaling(args.overrides, args.out)
    print(render(result))
    print(f"plot: {result['plot']}")
    return 0


if __name__ == "__main__":
    run_cli(main)
