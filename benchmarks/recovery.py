"""Recovery on the lab cluster: each fault drill several times, with medians.

For every drill, a 2-node job (3 for node-fail: one spare) is submitted, the fault is
injected with `python -m dtk.drill` once the job has trained a while, and the run must
finish. Per drill it prints the median of:

  detect_s    drill -> the driver's detection event (crash, hang, node-fail) or the workers'
              agreed stop (preempt, timelimit)
  recovery_s  detection -> first completed step after the restart (the `resumed` event)
  lost        steps computed before the fault that had to be computed again: the last
              completed step the driver recorded at the fault (the detection event's
              `step`; else the last step logged) - the step resumed from
  tier        where that step came from: disk (the run directory's checkpoints), memory
              (each node's own snapshot store) or peer (a replica on another node)

With `--memory-every 0,5` every drill runs with the in-memory tier off and at 5, side by
side (crash, hang and node-fail are what the tier serves; preemption and time limits save
to disk either way).

next to the run's median step time and checkpoint save time. The `grow` drill sets a node
of a 2-node job DOWN while the third node is busy (no spare): the job goes on on 1 node;
the node is resumed at once, and the job grows back to 2. Its extra figures:

  returned_s  node resumed -> the driver's `node_returned` (its health job passed)
  grow_s      node resumed -> first completed step on 2 nodes again (the grown start's `resumed`)
  grow_lost   steps lost by growing back (stop step - step resumed from): 0 expected

Targets: recovery <= 30 s
after node failure, crash or hang; 0 steps lost on preempt and timelimit; at most one
checkpoint interval lost otherwise.

    python benchmarks/recovery.py [--repeats 3] [--drills crash,hang,...,grow] [--every 20] [--memory-every 0,5]
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

from dtk.common.audit import AUDIT_DIR
from dtk.common.rundir import EVENTS, METRICS, SUMMARY

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO))
DETECTION = {"crash": "relaunched", "hang": "hang_detected", "node-fail": "node_failed",
             "preempt": "preempted", "timelimit": "preempted"}


def dtk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=ENV, capture_output=True, text=True)


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / EVENTS).read_text().splitlines()]


def metrics(run: Path) -> list[dict]:
    path = run / METRICS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def grow(root: Path, args) -> dict:
    hold = subprocess.run(["sbatch", "--parsable", "-w", "node3", "-N1", "--job-name=dtk-bench-hold",
                           "--output=/dev/null", "--wrap=sleep 900"], capture_output=True, text=True).stdout.strip()
    wait(lambda: subprocess.run(["squeue", "-h", "-j", hold, "-o", "%T"], capture_output=True,
                                text=True).stdout.strip() == "RUNNING", 30, "the job holding node3")
    victim = None
    try:
        proc = dtk("dtk.submit", "cluster=lab", "nodes=2", "tasks_per_node=1", "train.global_batch=32",
                   f"train.steps={args.steps * 5}", f"checkpoint.every={args.every}", f"run.root={root}")
        if proc.returncode != 0:
            raise SystemExit(proc.stdout + proc.stderr)
        job = proc.stdout.split("submitted job ", 1)[1].split()[0]
        (run,) = [p for p in root.iterdir() if p.is_dir() and p.name != AUDIT_DIR]
        wait(lambda: any(m["step"] >= args.at for m in metrics(run)), 180, f"step {args.at}")
        victim = [e for e in events(run) if e["event"] == "started"][0]["nodes"][-1]
        t_drill = time.time()
        out = dtk("dtk.drill", "node-fail", str(run))
        if out.returncode != 0:
            raise SystemExit(out.stdout + out.stderr)
        wait(lambda: any(e["event"] == "node_failed" for e in events(run)), 120, "node_failed")
        t_back = time.time()
        subprocess.run(["scontrol", "update", f"nodename={victim}", "state=resume"], capture_output=True)
        wait(lambda: not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip(),
             600, f"job {job} to end")
    finally:
        subprocess.run(["scancel", hold], capture_output=True)
        if victim:
            subprocess.run(["scontrol", "update", f"nodename={victim}", "state=resume"], capture_output=True)
    evs = events(run)
    first = {name: next((e for e in evs if e["event"] == name), None) for name in ("node_failed", "node_returned", "grown")}
    if None in first.values():
        raise SystemExit(f"grow: missing events {first} ({run})")
    shrunk = next(e for e in evs if e["event"] == "resumed" and e["time"] >= first["node_failed"]["time"])
    regrown = next(e for e in evs if e["event"] == "resumed" and e["time"] >= first["grown"]["time"])
    stop = [e for e in evs if e["event"] == "preempted"][-1]
    saves = [e["seconds"] for e in evs if e["event"] == "checkpoint_saved"]
    return {
        "detect_s": first["node_failed"]["time"] - t_drill,
        "recovery_s": shrunk["recovery_s"],
        "lost": 0.0,
        "step_s": statistics.median(m["step_time_s"] for m in metrics(run)),
        "save_s": statistics.median(saves),
        "returned_s": first["node_returned"]["time"] - t_back,
        "grow_s": regrown["time"] - t_back,
        "grow_lost": stop["step"] - regrown["step"],
    }


def one(kind: str, root: Path, args, memory_every: int) -> dict:
    if kind == "grow":
        return grow(root, args)
    extra = ["spare_nodes=1"] if kind == "node-fail" else []
    if kind == "timelimit":
        extra += ["fault.signal_lead_floor_s=30"]
    # A time-limit drill needs the run to outlast the cut limit (lead + 15 s) plus Slurm's
    # time-limit sweep, which runs about every 30 s.
    steps = args.steps * 5 if kind == "timelimit" else args.steps
    proc = dtk("dtk.submit", "cluster=lab", "nodes=2", "tasks_per_node=1", "train.global_batch=32",
               f"train.steps={steps}", f"checkpoint.every={args.every}", "fault.hang_timeout_s=10",
               f"checkpoint.memory_every={memory_every}", *extra, f"run.root={root}")
    if proc.returncode != 0:
        raise SystemExit(proc.stdout + proc.stderr)
    job = proc.stdout.split("submitted job ", 1)[1].split()[0]
    (run,) = [p for p in root.iterdir() if p.is_dir() and p.name != AUDIT_DIR]
    wait(lambda: any(m["step"] >= args.at for m in metrics(run)), 180, f"step {args.at}")
    nodes = [e for e in events(run) if e["event"] == "started"][0]["nodes"]
    t_drill = time.time()
    out = dtk("dtk.drill", kind, str(run), *(["--hold", "5"] if kind == "preempt" else []))
    if out.returncode != 0:
        raise SystemExit(out.stdout + out.stderr)
    try:
        wait(lambda: not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip(),
             420, f"job {job} to end")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        for node in nodes:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
    evs = events(run)
    summary = json.loads((run / SUMMARY).read_text())
    if summary.get("status") != "finished":
        raise SystemExit(f"{kind}: the run did not finish: {summary}")
    detected = next((e for e in evs if e["event"] == DETECTION[kind] and e["time"] >= t_drill), None)
    if detected is None:
        raise SystemExit(f"{kind}: no {DETECTION[kind]} event after the drill; the run ended first? ({run})")
    resumed = next(e for e in evs if e["event"] == "resumed" and e["time"] >= detected["time"])
    loaded = next(e for e in evs if e["event"] == "checkpoint_loaded" and e["time"] >= detected["time"])
    reached = detected.get("step")
    if reached is None:  # an event without the driver's count: the last step logged before the fault
        reached = max(m["step"] for m in metrics(run) if m["restart"] == resumed["restart"] - 1)
    saves = [e["seconds"] for e in evs if e["event"] == "checkpoint_saved"]
    return {
        "detect_s": detected["time"] - t_drill,
        "recovery_s": resumed["recovery_s"],
        "lost": reached - resumed["step"],
        "step_s": statistics.median(m["step_time_s"] for m in metrics(run)),
        "save_s": statistics.median(saves),
        "tier": loaded.get("tier", "disk"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drills", default="preempt,timelimit,node-fail,crash,hang")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--at", type=int, default=100, help="drill once this step is logged")
    p.add_argument("--every", type=int, default=20, help="checkpoint interval (steps)")
    p.add_argument("--memory-every", default="0",
                   help="checkpoint.memory_every values, comma-separated (0: the tier off), each run for every drill")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    from dtk import lab

    lab.up(3, install=False, log=lambda _line: None)
    rows = []
    for kind in args.drills.split(","):
        for memory_every in [int(m) for m in args.memory_every.split(",")]:
            results = []
            for r in range(args.repeats):
                with tempfile.TemporaryDirectory() as tmp:
                    results.append(one(kind, Path(tmp), args, memory_every))
                print(f"{kind} memory_every={memory_every} #{r}: "
                      + " ".join(f"{k} {v:.3g}" if isinstance(v, float | int) else f"{k} {v}"
                                 for k, v in results[-1].items()), flush=True)
            medians = {k: statistics.median(res[k] for res in results) for k in results[0] if k != "tier"}
            tiers = sorted({res.get("tier", "disk") for res in results})
            rows.append((kind, memory_every, medians, "/".join(tiers)))
    print(f"\nmedians of {args.repeats} (checkpoint every {args.every} steps):")
    print(f"{'drill':<10} {'memory':>6} {'detect_s':>9} {'recovery_s':>11} {'lost':>5} {'tier':>12} {'step_s':>7}"
          f" {'save_s':>7}")
    for kind, memory_every, m, tier in rows:
        print(f"{kind:<10} {memory_every or 'off':>6} {m['detect_s']:>9.1f} {m['recovery_s']:>11.1f} {m['lost']:>5.0f}"
              f" {tier:>12} {m['step_s']:>7.3f} {m['save_s']:>7.3f}"
              + (f"  returned_s {m['returned_s']:.1f} grow_s {m['grow_s']:.1f} grow_lost {m['grow_lost']:.0f}"
                 if "grow_s" in m else ""))


if __name__ == "__main__":
    main()
