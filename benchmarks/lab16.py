"""A 16-node job on the lab cluster: time from `dtk.submit` to the run's end.

Brings the lab up with 16 nodes (restarting it if it runs another count), submits a tiny
16-node job (one worker per node, world 16, all on this machine's cores) with
submit.wait=true, and prints the wall time from submission to the finished summary,
split into queue wait (submit -> `started` event) and run (`started` -> `finished`).

    python benchmarks/lab16.py [--steps 5] [--repeats 1] [--keep-lab]
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

from dtk.common.rundir import EVENTS, METRICS

REPO = Path(__file__).resolve().parents[1]


def once(steps: int, root: Path) -> tuple[float, float, float]:
    cmd = [sys.executable, "-m", "dtk.submit", "cluster=lab", "nodes=16", "tasks_per_node=1",
           f"train.steps={steps}", "train.global_batch=32", "submit.wait=true", f"run.root={root}"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    total = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"16-node job failed:\n{proc.stdout}\n{proc.stderr}")
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    events = [json.loads(line) for line in (run / EVENTS).read_text().splitlines()]
    started = next(e["time"] for e in events if e["event"] == "started")
    finished = next(e["time"] for e in events if e["event"] == "finished")
    world = {json.loads(line)["world_size"] for line in (run / METRICS).read_text().splitlines()}
    assert world == {16}, world
    return total, started - t0, finished - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--keep-lab", action="store_true", help="leave the 16-node lab up afterwards")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    from dtk import lab

    t0 = time.time()
    lab.up(16, install=False, log=lambda _line: None)
    up_s = time.time() - t0
    results = []
    try:
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                results.append(once(args.steps, Path(tmp)))
                print(f"submit -> finished {results[-1][0]:.1f} s (queue {results[-1][1]:.1f} s,"
                      f" start-up + {args.steps} steps {results[-1][2]:.1f} s)", flush=True)
    finally:
        if not args.keep_lab:
            lab.down(log=lambda _line: None)
    med = [statistics.median(r[i] for r in results) for i in range(3)]
    print(f"lab up --nodes 16: {up_s:.1f} s; 16-node job, world 16, {args.steps} steps:"
          f" submit -> finished {med[0]:.1f} s (median of {len(results)}; queue {med[1]:.1f} s, run {med[2]:.1f} s)")


if __name__ == "__main__":
    main()
