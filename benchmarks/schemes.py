"""Step time and peak memory per rank of every scheme, 4 CPU worker processes (gloo).

Each scheme trains the same model on the same data through the real CLI
(`python -m dtk.submit`), twice:

- time: the median of the logged `step_time_s` after 2 warm-up steps, in `--repeats`
  rounds over all schemes; the table gives the median over rounds, and the ratio to ddp
  is taken within each round (this machine's load changes from minute to minute);
- memory: each worker's peak resident set size (RSS), sampled from outside every 50 ms
  until the last training step is logged (the final checkpoint is not counted). This run
  sets MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns freed tensors to the system at
  once; otherwise RSS keeps the high-water mark of every transient buffer and says more
  about the allocator than about the scheme. RSS includes what every torch process holds
  before it builds anything (~0.35 GiB here), so the differences between schemes are the
  signal; the model's own state (parameters + gradients + AdamW moments, fp32) is
  printed for scale.

    python benchmarks/schemes.py                  # all schemes, the table for docs/benchmarks.md
    python benchmarks/schemes.py --only fsdp tp   # a subset (name prefixes)
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

import psutil

from dtk.common.rundir import LOGS_DIR, METRICS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = ["model.dim=384", "model.num_layers=8", "model.num_heads=8", "model.vocab_size=8192", "model.seq_len=32"]
JOB = [
    "tasks_per_node=4",
    "train.global_batch=16",
    "train.micro_batch=4",
    "train.log_every=1000",
    "optim.warmup_steps=2",
    "checkpoint.every=0",
    "checkpoint.async_save=false",
    "data.num_samples=1024",
]

# name -> overrides; the degrees are on the 4 workers of JOB.
SCHEMES = {
    "ddp": ["+scheme=ddp"],
    "zero": ["+scheme=zero"],
    "fsdp (ZeRO-3)": ["+scheme=fsdp"],
    "fsdp (ZeRO-2)": ["+scheme=fsdp", "scheme.reshard_after_forward=false"],
    "hsdp 2x2": ["+scheme=hsdp", "scheme.dp_replicate=2"],
    "tp 4": ["+scheme=tp"],
    "tp 4 + sp": ["+scheme=tp", "scheme.sequence_parallel=true"],
    "pp 4 1f1b": ["+scheme=pp"],
    "pp 2 interleaved x dp 2": [
        "+scheme=pp", "scheme.pp=2", "scheme.dp_shard=2", "scheme.pp_schedule=interleaved_1f1b",
        "scheme.pp_virtual_stages=2",
    ],
    "hybrid dp 2 x tp 2": ["+scheme=hybrid", "scheme.dp_shard=2", "scheme.tp=2"],
    "hybrid pp 2 x dp 2": ["+scheme=hybrid", "scheme.pp=2", "scheme.dp_shard=2", "scheme.tp=1"],
    "fsdp + full AC": ["+scheme=fsdp", "scheme.activation_checkpoint=full"],
}


def model_state_mib(dim: int = 384, num_layers: int = 8, vocab: int = 8192, seq: int = 32) -> float:
    from dtk.plan.shape import ffn_hidden_size

    hidden = ffn_hidden_size(dim, 0)
    params = 2 * vocab * dim + seq * dim + num_layers * (4 * dim * dim + 3 * dim * hidden + 2 * dim) + dim
    return params * 4 * 4 / 2**20  # fp32 parameters, gradients, two AdamW moments


def run_scheme(overrides: list[str], steps: int, root: Path, *, memory: bool) -> tuple[list[dict], dict[int, int]]:
    """Train once; returns the metrics records and, when `memory`, the peak RSS per rank."""
    run = root / "run"
    cmd = [sys.executable, "-m", "dtk.submit", *MODEL, *JOB, *overrides, f"train.steps={steps}",
           f"run.root={root}", "run.name=run"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak: dict[int, int] = {}
    pids_file = run / LOGS_DIR / "start_00" / "pids"
    metrics = run / METRICS
    workers: list[psutil.Process] = []
    while proc.poll() is None:
        if memory:
            if not workers and pids_file.is_file():
                workers = [psutil.Process(int(p)) for p in pids_file.read_text().split()]
            if not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
                for rank, w in enumerate(workers):
                    try:
                        peak[rank] = max(peak.get(rank, 0), w.memory_info().rss)
                    except psutil.NoSuchProcess:
                        pass
        time.sleep(0.05)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)}: exit {proc.returncode}\n{out[-3000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()], peak


def step_ms(overrides: list[str], steps: int) -> float:
    with tempfile.TemporaryDirectory(prefix="dtk-bench-") as tmp:
        records, _ = run_scheme(overrides, steps, Path(tmp), memory=False)
    return 1000 * statistics.median(r["step_time_s"] for r in records if r["step"] > 2)


def peak_gib(overrides: list[str]) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="dtk-bench-") as tmp:
        _, peak = run_scheme(overrides, 3, Path(tmp), memory=True)
    return [peak[r] / 2**30 for r in sorted(peak)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per timing run (the first 2 are warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds over all schemes; medians are reported")
    parser.add_argument("--only", nargs="*", help="scheme names (prefixes) to run; ddp is always run as the baseline")
    args = parser.parse_args()
    names = [k for k in SCHEMES if k == "ddp" or not args.only or any(k.startswith(o) for o in args.only)]
    times: dict[str, list[float]] = {n: [] for n in names}
    # Rounds over all schemes, so a change in the machine's load hits every scheme alike;
    # each ratio to ddp is taken within one round.
    for round_ in range(args.repeats):
        for name in names:
            times[name].append(step_ms(SCHEMES[name], args.steps))
            print(f"round {round_ + 1}: {name} {times[name][-1]:.0f} ms/step", flush=True)
    peaks = {}
    for name in names:
        peaks[name] = peak_gib(SCHEMES[name])
        print(f"{name}: peak RSS per rank {' / '.join(f'{g:.2f}' for g in peaks[name])} GiB", flush=True)
    print(f"\nmodel state (params + grads + AdamW, fp32, unsharded): {model_state_mib():.0f} MiB")
    print("\n| scheme | overrides | ms/step | time vs ddp | peak RSS per rank (GiB) | max rank vs ddp (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        ratio = statistics.median(t / b for t, b in zip(times[name], times["ddp"], strict=True))
        delta = (max(peaks[name]) - max(peaks["ddp"])) * 1024
        print(
            f"| {name} | `{' '.join(SCHEMES[name])}` | {statistics.median(times[name]):.0f} | {ratio:.2f} |"
            f" {' / '.join(f'{g:.2f}' for g in peaks[name])} | {delta:+.0f} |"
        )


if __name__ == "__main__":
    main()
