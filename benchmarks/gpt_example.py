"""examples/gpt end to end: the GPT-2-style model of the example's own (tied head, printing
constructor, forward(idx, targets) -> (logits, loss)) on the standard library's sources,
trained by dtk under ddp and fsdp on 2 worker processes and by the plain PyTorch loop of
examples/gpt/plain.py in one process, with the same model, batches, schedule and steps.

The example is copied to a temporary folder; its corpus is written and prepared there as
its README says (--tokenizer chars --val-fraction 0.1). Printed: the loss at 4 steps of
each, the last validation loss, and tokens/s (dtk: global batch x seq_len / the median
logged step time; plain: the median over its steps of the same), then the largest
relative loss difference of each dtk run against the plain loop of the same seed, and
of the plain loop against itself with another seed (the noise of the seed alone).

    python benchmarks/gpt_example.py                # 200 steps, the table for docs/benchmarks.md
    python benchmarks/gpt_example.py --steps 20     # a quick look
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dtk.common.rundir import EVAL_LOG, METRICS, PLAN_JSON

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt"


def run(cmd: list[str], cwd: Path) -> str:
    print(f"running: {' '.join(cmd)}", file=sys.stderr, flush=True)
    argv = [sys.executable, *cmd[1:]] if cmd[0] == "python" else cmd
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def dtk_run(folder: Path, name: str, steps: int, *extra: str) -> dict:
    run(["python", "-m", "dtk.submit", f"train.steps={steps}", f"run.name={name}", *extra], folder)
    run_dir = folder / "runs" / name
    metrics = {r["step"]: r for r in records(run_dir / METRICS)}
    evals = records(run_dir / EVAL_LOG)
    plan = json.loads((run_dir / PLAN_JSON).read_text())
    tokens = plan["global_batch"] * plan["config"]["model"]["seq_len"]
    step_s = statistics.median(r["step_time_s"] for s, r in metrics.items() if s > 2)
    return {"loss": {s: r["loss"] for s, r in metrics.items()}, "val_loss": evals[-1]["val_loss"],
            "tokens_per_s": tokens / step_s, "command": f"python -m dtk.submit train.steps={steps} {' '.join(extra)}".strip()}


def plain_run(folder: Path, seed: int, steps: int) -> dict:
    out = folder / f"plain-{seed}.jsonl"
    cmd = ["python", "plain.py", "--steps", str(steps), "--seed", str(seed), "--out", out.name]
    run(cmd, folder)
    recs = records(out)
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    return {"loss": {r["step"]: r["loss"] for r in recs}, "val_loss": val[-1],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs if r["step"] > 2),
            "command": " ".join(cmd[:-2])}


def largest_rel(a: dict[int, float], b: dict[int, float]) -> float:
    return max(abs(a[s] - b[s]) / abs(a[s]) for s in a if s in b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpt-example-") as tmp:
        folder = Path(tmp) / "gpt"
        # Not a data/ or runs/ folder a user made in the example itself (conf/data/ is needed).
        shutil.copytree(EXAMPLE, folder, ignore=lambda d, names: [n for n in names if n == "__pycache__" or (
            Path(d) == EXAMPLE and (n in ("data", "runs") or n.endswith(".jsonl")))])
        run(["python", "gpt.py", "corpus"], folder)
        run(["python", "-m", "dtk.data", "prepare", "--input", "data/stdlib.txt", "--out", "data/stdlib",
             "--tokenizer", "chars", "--val-fraction", "0.1"], folder)
        results = {"dtk ddp, 2 ranks": dtk_run(folder, "ddp", args.steps),
                   "dtk fsdp, 2 ranks": dtk_run(folder, "fsdp", args.steps, "+scheme=fsdp"),
                   "plain, seed 0": plain_run(folder, 0, args.steps),
                   "plain, seed 1": plain_run(folder, 1, args.steps)}
    points = [1, args.steps // 4, args.steps // 2, args.steps]
    print(f"| run | {' | '.join(f'loss @{s}' for s in points)} | val_loss @{args.steps} | tokens/s | command |")
    print(f"| --- | {' | '.join('---' for _ in points)} | --- | --- | --- |")
    for name, r in results.items():
        losses = " | ".join(f"{r['loss'][s]:.4f}" for s in points)
        print(f"| {name} | {losses} | {r['val_loss']:.4f} | {r['tokens_per_s']:,.0f} | `{r['command']}` |")
    plain = results["plain, seed 0"]["loss"]
    print()
    for name in ("dtk ddp, 2 ranks", "dtk fsdp, 2 ranks", "plain, seed 1"):
        print(f"largest relative loss difference, {name} against plain seed 0: "
              f"{largest_rel(plain, results[name]['loss']):.3g}")


if __name__ == "__main__":
    main()
