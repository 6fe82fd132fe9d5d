"""The pieces of benchmarks/gpu_check.sh, one subcommand each, so a new figure is one more
function here and one more line there. Every subcommand prints `name  value` lines.

    python benchmarks/gpu_check.py device                 the GPU, its accelerator entry and dense peaks
    python benchmarks/gpu_check.py throughput RUN [PLAN]  tokens/s, TFLOP/s, MFU, peak memory vs the plan,
                                                          checkpoint blocking time and save throughput
    python benchmarks/gpu_check.py syncs                  host-device syncs per training step (CUDA's sync debug mode)
    python benchmarks/gpu_check.py equivalence REF RUN..  the runs' per-step losses against REF's

FLOPs convention (printed with the figures): per token 6 FLOPs per matmul weight (forward
2, backward 4) plus attention's 12 x layers x dim x seq (the full square), as in
dtk/train/flops.py; activation recomputation is not credited. MFU is per-device TFLOP/s
over the dense (no sparsity) peak of the dtype the matmuls run in.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtk.common.rundir import EVENTS, HEARTBEAT, METRICS, SUMMARY
from dtk.plan.accelerators import ACCELERATORS, accelerator_of  # noqa: E402

GIB = 2**30
WARMUP_STEPS = 10  # compile and the allocator's first steps: left out of the medians
LOSS_RTOL = 1e-4  # fp32 runs of different schemes: only the reduction orders differ


def device() -> None:
    import torch

    props = torch.cuda.get_device_properties(0)
    name = accelerator_of(props.name)
    acc = ACCELERATORS[name] if name else None
    print(f"device          {props.name}, {props.total_memory / GIB:.1f} GiB, {torch.cuda.device_count()} visible")
    if acc is None:
        print("accelerator     not in dtk.plan.accelerators: no MFU (set PEAK_TFLOPS)")
    else:
        print(f"accelerator     {acc.name}: dense peak bf16 {acc.bf16_tflops:g}, tf32 {acc.tf32_tflops:g},"
              f" fp32 {acc.fp32_tflops:g} TFLOP/s")
    print(f"bf16 supported  {torch.cuda.is_bf16_supported()}")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def memory_figure(summary: dict, budget: dict | None) -> str:
    """Peak memory against dtk.plan's prediction, as the workers recorded both in
    summary.json (`memory`: every rank's torch.cuda.max_memory_allocated against its planned
    states + activations + buffers); `budget` (python -m dtk.plan --json) adds the total
    with the margin."""
    memory = summary.get("memory") or {}
    if memory.get("measured_bytes") is None or not memory.get("predicted_bytes"):
        why = memory.get("error") or "summary.json has no prediction"
        return f"peak memory     {summary.get('peak_memory_gib')} GiB measured (rank 0); not against the plan: {why}"
    measured, predicted = memory["measured_bytes"], memory["predicted_bytes"]
    text = (f"peak memory     {measured / GIB:.2f} GiB measured ({memory['basis']}, largest rank) against"
            f" {predicted / GIB:.2f} GiB predicted by dtk.plan (states + activations + buffers):"
            f" measured / predicted {measured / predicted:.2f}")
    if memory["mismatch_ranks"]:
        text += f" (plan_mismatch on rank(s) {', '.join(map(str, memory['mismatch_ranks']))})"
    total = ((budget or {}).get("per_device_bytes") or {}).get("total")
    if total:
        text += f"; {total / GIB:.2f} GiB with the plan's margin"
    return text


def throughput(run: Path, plan_json: Path | None) -> None:
    import torch

    from dtk.common.rundir import RunDir
    from dtk.plan.plan import Plan

    plan = Plan.from_json(RunDir(run).plan_json.read_text())
    records = [r for r in _jsonl(run / METRICS) if "step" in r]
    warm = [r for r in records if r["step"] > WARMUP_STEPS] or records[len(records) // 2 :]
    summary = json.loads((run / SUMMARY).read_text())
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in warm)
    print(f"steps           {len(records)}; medians over steps {warm[0]['step']}-{warm[-1]['step']},"
          f" {plan.world_size} GPU(s)")
    print(f"tokens/s        {tokens_per_s:,.0f} (all GPUs)")
    # TFLOP/s and MFU as the worker logged them: the code path of every run (dtk.train.flops).
    per_token = summary.get("flops_per_token")
    if "tflops" in warm[-1] and per_token:
        print(f"TFLOP/s         {statistics.median(r['tflops'] for r in warm):.1f} per GPU ({per_token / 1e9:.2f}"
              " GFLOP/token: 6 x matmul weights + 12 x layers x dim x seq attention, recomputation not credited)")
    else:
        print("TFLOP/s         unknown (no FLOPs count for this model)")
    mfus = [r["mfu"] for r in warm if "mfu" in r]
    if mfus:
        print(f"MFU             {100 * statistics.median(mfus):.1f}% of {summary['peak_tflops']:.1f} TFLOP/s dense peak"
              f" ({accelerator_of(torch.cuda.get_device_name(0)) or 'cluster.peak_tflops'})")
    else:
        print("MFU             unknown: this GPU is not in dtk's accelerator table; set PEAK_TFLOPS")
    print(memory_figure(summary, json.loads(plan_json.read_text()) if plan_json and plan_json.exists() else None))
    saves = [e for e in _jsonl(run / EVENTS) if e.get("event") == "checkpoint_saved"]
    for e in saves:
        print(checkpoint_figure(e))
    if not saves:
        print("checkpoint      no checkpoint_saved event")


def checkpoint_figure(saved: dict) -> str:
    """One `checkpoint_saved` event: how long training was blocked, how long the copy to
    (pinned) host memory took beside training (async), and the time to the committed manifest."""
    rate = saved["bytes"] / saved["seconds"] / 1e9 if saved.get("seconds") else float("nan")
    stage = saved.get("staging_seconds")
    return (f"checkpoint      step {saved['step']} ({'async' if saved.get('asynchronous') else 'sync'}):"
            f" {saved['bytes'] / 1e9:.2f} GB; block {saved['blocked_seconds']:.2f} s (training waited),"
            f" stage {'-' if stage is None else f'{stage:.2f} s'} (copy to host memory),"
            f" commit {saved['seconds']:.1f} s (to the committed manifest) = {rate:.2f} GB/s")


SYNC_STEPS, SYNC_INTERVAL = 30, 10  # steps measured, and the metrics' read interval (train.log_every) they use


def syncs(device_name: str = "cuda") -> None:
    """A small model trained on the GPU through dtk's loop and policies with CUDA's sync
    debug mode on: every operation that makes the host wait for the device warns; the
    warnings per step are the syncs per step. `device_name` cpu runs the same loop without
    counting (the CPU has no syncs to see): a check of this script without a GPU."""
    import tempfile

    import torch

    from dtk.common.rundir import RunDir
    from dtk.data.loader import StepBatches
    from dtk.data.synthetic import SyntheticTokens
    from dtk.mesh.mesh import ParallelMesh
    from dtk.models.transformer import build
    from dtk.train.loss import TokenCrossEntropy
    from dtk.train.metrics import MetricsLog
    from dtk.train.policies import AgreedStop, Heartbeat, StepPolicies
    from dtk.train.profile import StepProfiler
    from dtk.train.task import LmTask
    from dtk.train.trainer import Trainer
    from dtk.worker.signals import StopFlag

    class Nothing:
        def after_step(self, step, result) -> None:
            pass

    steps, log_every = SYNC_STEPS, SYNC_INTERVAL
    dev = torch.device(device_name, 0) if device_name == "cuda" else torch.device(device_name)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    with torch.device(dev):
        model = build(vocab_size=256, dim=128, num_layers=2, num_heads=4, seq_len=64)
    data = SyntheticTokens(num_samples=512, seq_len=64, vocab_size=256, seed=0, branching=2)
    batches = StepBatches(data, seed=0, global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, device=dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with tempfile.TemporaryDirectory() as folder:
        run = RunDir(Path(folder))
        metrics = MetricsLog(run.metrics, world_size=1, restart=0, global_batch=8, tokens_per_step=512,
                             total_steps=2 * steps, log_every=log_every, samples_per_epoch=None, flops_per_token=None,
                             peak_tflops=None)
        profiler = StepProfiler(device=dev, enabled=True, straggler_factor=1.5, run=None, rank=0, log_every=log_every,
                                total_steps=2 * steps, metrics=metrics, saving=None)
        trainer = Trainer(model=model, optimizer=optimizer, scheduler=scheduler, batches=batches,
                          task=LmTask(TokenCrossEntropy()), grad_clip=1.0, mesh=ParallelMesh.single(),
                          timer=profiler.timer)
        flag = StopFlag()
        stop = AgreedStop(agreed=lambda s: flag.vote(None, s), checkpoints=Nothing(), total_steps=2 * steps, run=None,
                          restart=0, budget_s=1.0)
        policies = StepPolicies(metrics=metrics, heartbeat=Heartbeat(Path(folder) / HEARTBEAT), resumed=Nothing(),
                                evaluation=Nothing(), checkpoint=Nothing(), stop=stop, profile=profiler)
        trainer.fit(start_step=0, total_steps=steps, policies=policies)  # warm-up: allocator, first copies
        if cuda:
            torch.cuda.synchronize()
        caught: list[tuple[str, str]] = []
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = recorder(caught)  # restored by catch_warnings
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.fit(start_step=steps, total_steps=2 * steps, policies=policies)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        metrics.close()
        profiler.close()
        batches.close()
    training, others = split_syncs(caught, training_thread=threading.current_thread().name)
    if not cuda:
        print(f"host syncs      not counted on {dev.type} ({2 * steps} steps of the loop ran; counting needs CUDA)")
        return
    print(f"host syncs      {len(training) / steps:.2f} per step in the training thread ({len(training)} over {steps}"
          f" steps, train.log_every={log_every}; CUDA sync debug mode); {len(others)} in other threads (the loader's"
          " copies), not counted")
    for line in sorted(set(training))[:5]:
        print(f"  sync: {line[:150]}")


def recorder(caught: list[tuple[str, str]]):
    """A warnings.showwarning that keeps (thread name, first line) of each warning: CUDA's
    sync debug mode warns in the thread that synchronized."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        caught.append((threading.current_thread().name, str(message).splitlines()[0] if str(message) else ""))
    return show


def split_syncs(caught: list[tuple[str, str]], *, training_thread: str) -> tuple[list[str], list[str]]:
    """The sync warnings of the training thread, and those of every other thread (the
    loader's copies, a checkpoint stager): only the first are the loop's syncs per step."""
    syncs = [(thread, text) for thread, text in caught if "synchroniz" in text]
    return ([t for th, t in syncs if th == training_thread], [t for th, t in syncs if th != training_thread])


def equivalence(reference: Path, runs: list[Path]) -> int:
    def losses(run: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in _jsonl(run / METRICS) if "step" in r}

    want = losses(reference)
    failed = 0
    for run in runs:
        got = losses(run)
        if sorted(got) != sorted(want):
            print(f"equivalence     {run.name}: steps {sorted(got)} differ from {reference.name}'s")
            failed += 1
            continue
        worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
        ok = worst <= LOSS_RTOL
        failed += not ok
        print(f"equivalence     {run.name} vs {reference.name}: max relative loss difference {worst:.2e}"
              f" over {len(want)} steps ({'ok' if ok else 'FAILED'}, tolerance {LOSS_RTOL:g})")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("device")
    t = sub.add_parser("throughput")
    t.add_argument("run", type=Path)
    t.add_argument("plan_json", type=Path, nargs="?")
    sy = sub.add_parser("syncs")
    sy.add_argument("--device", default="cuda", help="cuda (default); cpu runs the loop without counting")
    e = sub.add_parser("equivalence")
    e.add_argument("reference", type=Path)
    e.add_argument("runs", type=Path, nargs="+")
    args = ap.parse_args(argv)
    if args.what == "device":
        device()
    elif args.what == "throughput":
        throughput(args.run, args.plan_json)
    elif args.what == "syncs":
        syncs(args.device)
    else:
        return equivalence(args.reference, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
