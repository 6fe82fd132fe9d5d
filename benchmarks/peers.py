"""dtk against Lightning Fabric and a plain torchrun DDP loop: the same model, the same
batches, the same AdamW and schedule, 2 CPU ranks (gloo) each.

  dtk     `python -m dtk.submit` on the local cluster (tasks_per_node=2); its checkpoints are
          dtk's (async, sharded, CRCs, manifest); a killed worker is relaunched by dtk's
          driver, which resumes from the newest checkpoint that verifies.
  fabric  benchmarks/peer_loops/fabric_loop.py: Fabric(accelerator=cpu, devices=2,
          strategy=ddp, gloo), fabric.save / fabric.load of one file.
  plain   benchmarks/peer_loops/plain_ddp.py under `torchrun --standalone --nproc-per-node 2`:
          DDP, torch.save of one file by rank 0.

The model, data and optimizer of the two loops are dtk's own builders, composed from the
same overrides dtk.submit gets (benchmarks/peer_loops/common.py). Fabric and the plain loop
run under benchmarks/peer_loops/relaunch.py, a small wrapper that restarts the command
when it fails (the loop resumes from its last checkpoint).

Each run trains --steps steps, saving every --every; once a checkpoint exists and training
is --kill-after steps past it, rank 1 gets SIGKILL. Per run:

  step      median of the per-step times (batch fetch to optimizer step done; dtk's
            `step_time_s` is the same span), over the steps of both starts
  first     the command started -> its first step done (imports, process group, model)
  save      seconds training waited for a save (dtk: `blocked_seconds` of its
            checkpoint_saved events; the loops: the save call and its barrier), median
  resume    SIGKILL -> the first step done after the restart (detection, relaunch,
            imports, load)

Ratios are to the plain loop of the same round (median of per-round ratios); the three
kinds run interleaved in each round. Targets: dtk's step within 2% of plain and not slower
than Fabric's; dtk's resume not slower than Fabric's.

    python benchmarks/peers.py --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOPS = REPO / "benchmarks" / "peer_loops"
sys.path.insert(0, str(REPO))

from dtk.common.rundir import EVENTS, LOGS_DIR, METRICS, PROGRESS  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=str(REPO))
KINDS = ("plain", "fabric", "dtk")


def shared(args) -> list[str]:
    """What all three are given: model, data, batch, optimizer, steps, checkpoint interval."""
    return [f"model.dim={args.dim}", f"model.num_layers={args.layers}", "model.num_heads=4",
            f"model.vocab_size={args.vocab}", f"model.seq_len={args.seq_len}", "data.num_samples=4096",
            f"train.global_batch={args.batch}", f"train.steps={args.steps}", "optim.warmup_steps=5",
            f"checkpoint.every={args.every}"]


def command(kind: str, args, out: Path) -> list[str]:
    py = sys.executable
    if kind == "dtk":
        return [py, "-m", "dtk.submit", *shared(args), "tasks_per_node=2", f"train.micro_batch={args.batch // 2}",
                f"run.root={out}", "run.name=peers"]
    relaunch = [py, str(LOOPS / "relaunch.py"), "--max-restarts", "3", "--"]
    if kind == "fabric":
        return [*relaunch, py, str(LOOPS / "fabric_loop.py"), str(out), *shared(args)]
    return [*relaunch, py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(LOOPS / "plain_ddp.py"), str(out), *shared(args)]


def read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


class Probe:
    """Where a run stands: its last completed step, whether a checkpoint exists, rank 1's pid."""

    def __init__(self, kind: str, out: Path) -> None:
        self.kind, self.out = kind, out
        self.run = out / "peers"

    def last_step(self) -> int:
        if self.kind == "dtk":
            try:
                return int((self.run / PROGRESS).read_text().split()[1])
            except (FileNotFoundError, IndexError, ValueError):
                return 0
        records = read_jsonl(self.out / "steps.jsonl")
        return records[-1]["step"] if records else 0

    def checkpoint_step(self) -> int | None:
        if self.kind == "dtk":
            saved = [e["step"] for e in read_jsonl(self.run / EVENTS) if e["event"] == "checkpoint_saved"]
            return max(saved) if saved else None
        saved = [r["step"] for r in read_jsonl(self.out / "steps.jsonl") if r.get("save_s") is not None]
        return max(saved) if saved else None

    def rank1_pid(self) -> int | None:
        try:
            if self.kind == "dtk":
                return int((self.run / LOGS_DIR / "start_00" / "pids").read_text().split()[1])
            return int((self.out / "pids" / "1").read_text())
        except (FileNotFoundError, IndexError, ValueError):
            return None

    def records(self) -> list[dict]:
        """One per completed step: step, time (epoch s), step_time_s, restart."""
        if self.kind == "dtk":
            return read_jsonl(self.run / METRICS)
        return read_jsonl(self.out / "steps.jsonl")

    def saves(self) -> list[float]:
        if self.kind == "dtk":
            return [e["blocked_seconds"] for e in read_jsonl(self.run / EVENTS) if e["event"] == "checkpoint_saved"]
        return [r["save_s"] for r in read_jsonl(self.out / "steps.jsonl") if r.get("save_s") is not None]


def one_run(kind: str, args) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"dtk-peers-{kind}-") as tmp:
        out = Path(tmp)
        probe = Probe(kind, out)
        started = time.time()
        proc = subprocess.Popen(command(kind, args, out), cwd=out, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        killed_at = None
        deadline = time.monotonic() + args.timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"{kind}: no end after {args.timeout} s")
            if killed_at is None:
                saved = probe.checkpoint_step()
                pid = probe.rank1_pid()
                if saved is not None and pid is not None and probe.last_step() >= saved + args.kill_after:
                    killed_at = time.time()
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        output = proc.stdout.read() if proc.stdout else ""
        if proc.returncode != 0 or killed_at is None:
            raise SystemExit(f"{kind}: exit {proc.returncode}, killed={killed_at is not None}\n{output[-3000:]}")
        records = probe.records()
        after = [r for r in records if r["time"] > killed_at and r.get("restart", 0) > 0]
        if not after:
            raise SystemExit(f"{kind}: no step after the restart\n{output[-3000:]}")
        steady = [r["step_time_s"] for r in records if r["step"] > 2]
        return {"step": statistics.median(steady), "first": min(r["time"] for r in records) - started,
                "save": statistics.median(probe.saves()), "resume": min(r["time"] for r in after) - killed_at,
                "steps": len(records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of (plain, fabric, dtk); medians are reported")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10, help="checkpoint interval in steps")
    ap.add_argument("--kill-after", type=int, default=4, help="steps past a checkpoint before rank 1 is killed")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch (half per rank)")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    if importlib.util.find_spec("lightning_fabric") is None:
        raise SystemExit("error: lightning_fabric is not installed: it is in the dev extra (scripts/setup.sh --dev,"
                         " or pip install -e '.[dev]')")
    rows: list[dict[str, dict[str, float]]] = []
    load = [os.getloadavg()[0]]
    for r in range(args.repeats):
        row = {}
        for kind in KINDS:
            row[kind] = one_run(kind, args)
            load.append(os.getloadavg()[0])
            print(f"round {r + 1} {kind:6s} " + " ".join(f"{k} {v:.4f}" for k, v in row[kind].items()), flush=True)
        rows.append(row)

    def med(kind: str, key: str) -> float:
        return statistics.median(row[kind][key] for row in rows)

    def ratio(kind: str, key: str) -> float:
        return statistics.median(row[kind][key] / row["plain"][key] for row in rows)

    print(f"\nmodel dim={args.dim} layers={args.layers} vocab={args.vocab} seq={args.seq_len}, global batch"
          f" {args.batch} on 2 CPU ranks, {args.steps} steps, a save every {args.every}, rank 1 killed"
          f" {args.kill_after} steps after a save; {len(rows)} rounds, medians; load average"
          f" {min(load):.1f}-{max(load):.1f}")
    print("| | median step | command to first step | save (training blocked) | kill to next step |")
    print("| --- | --- | --- | --- | --- |")
    for kind in KINDS:
        cells = [f"{med(kind, k) * (1000 if k == 'step' else 1):.{1 if k == 'step' else 2}f}"
                 f" {'ms' if k == 'step' else 's'} ({ratio(kind, k):.3f})" for k in ("step", "first", "save", "resume")]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print("(ratio to plain in parentheses: median over rounds of the round's ratio)")
    print(f"dtk step / fabric step {statistics.median(row['dtk']['step'] / row['fabric']['step'] for row in rows):.3f};"
          f" dtk resume / fabric resume"
          f" {statistics.median(row['dtk']['resume'] / row['fabric']['resume'] for row in rows):.3f}")


if __name__ == "__main__":
    main()
