"""Checkpoint save: how long training is blocked by an async save vs a synchronous one, and
the write throughput of a save vs a raw sequential write (dd) on the same disk.

One process trains a stack of Linear layers with AdamW (the state - parameters and two
moments - is at least --state-mb) and saves through dtk's CheckpointManager, the code a
worker runs:

  sync    `save()` returns once the checkpoint is written, checksummed and committed:
          training is blocked for all of it.
  async   `save()` stages the state into CPU buffers kept between saves and returns;
          DCP writes and the manifest is committed in the background while training goes
          on. Blocked = the `save()` call, plus how much slower the steps that overlap the
          background write ran than steps without one (the GIL and the memory bus are
          shared), so the figure hides nothing.
  process the same with checkpoint.async_mode=process: DCP's checkpoint process writes the
          shards (spawned by the warm-up round), rank 0's finisher thread reads them back
          the CRCs as it writes them (the training process reads no shard back). Its total
          cost is measured the same way.

Throughput: bytes of the checkpoint / seconds of a synchronous save, from the start to the
committed manifest (fsynced DCP files, each checksummed as it is written, manifest) vs
`dd bs=8M conv=fsync` of the same number of bytes into the same folder. Target >= 0.80.

    python benchmarks/checkpoint.py --state-mb 600 --repeats 7

--load instead times a resume: dtk's verified load of one committed checkpoint (the
manager's `resume()` on a fresh model: manifest, sizes, DCP load with every file's CRC-32
checked, state applied) against a plain `torch.load` of the same model and optimizer
state saved with `torch.save`, then `load_state_dict` (and torch.load alone). Both read
from the page cache (each file was read once before the rounds).

    python benchmarks/checkpoint.py --load --state-mb 40 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from dtk.checkpoint.manager import CheckpointManager  # noqa: E402
from dtk.common.rundir import MANIFEST, RunDir  # noqa: E402
from dtk.config.choices import AsyncMode  # noqa: E402
from dtk.config.schema import CheckpointConfig  # noqa: E402
from dtk.mesh.mesh import ParallelMesh  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, no group: intended

DIM = 2048


def build(state_mb: int):
    # AdamW keeps two moments per parameter: state = 3 x parameters x 4 bytes.
    layers = max(1, -(-state_mb * 1_000_000 // (3 * 4 * DIM * DIM)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return model, optimizer, scheduler


def step(model, optimizer, scheduler, x) -> float:
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def manager(run: RunDir, parts, scheduler, *, asynchronous: bool, mode: str = "thread") -> CheckpointManager:
    return CheckpointManager(
        run,
        checkpoint=CheckpointConfig(every=0, keep=1, resume=False, async_save=asynchronous,
                                    async_mode=AsyncMode(mode)),
        parts=parts,
        scheduler=scheduler,
        mesh=ParallelMesh.single(),
        global_batch=1,
        total_steps=10**9,
        identity={"config_hash": "bench", "data_version": "bench", "scheme": "single"},
    )


def dd_seconds(folder: Path, nbytes: int) -> float:
    out = folder / "dd.bin"
    count = max(1, round(nbytes / (8 << 20)))
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={out}", "bs=8M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    out.unlink()
    return seconds * nbytes / (count * (8 << 20))


def settle() -> None:
    """Flush what earlier writes left dirty, so each measured write starts from a clean cache."""
    os.sync()
    time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mb", type=int, default=600, help="model + optimizer state to save, in MB (default 600)")
    ap.add_argument("--repeats", type=int, default=7, help="rounds of (sync save, async save, dd); medians are reported")
    ap.add_argument("--batch", type=int, default=8, help="rows of the training batch (sets the step time)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp folder under the cwd)")
    ap.add_argument("--load", action="store_true", help="time a verified load against a plain torch.load instead")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core computes, the other is free for the background write
    if args.load:
        load_main(args)
        return

    model, optimizer, scheduler = build(args.state_mb)
    parts = [(model, optimizer)]
    x = torch.randn(args.batch, DIM)
    folder = Path(tempfile.mkdtemp(prefix="dtk-ckpt-bench-", dir=args.dir or Path.cwd()))
    # The checkpoint process joins a group of its own, set up over the caller's: one rank here.
    dist.init_process_group("gloo", store=dist.FileStore(str(folder / "store"), 1), rank=0, world_size=1)
    rows = []
    try:
        for _ in range(3):
            step(model, optimizer, scheduler, x)
        state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
        managers = {}
        for kind in ("sync", "async", "process"):
            run = RunDir(folder / kind)
            run.path.mkdir()
            managers[kind] = manager(run, parts, scheduler, asynchronous=kind != "sync",
                                     mode="process" if kind == "process" else "thread")
        # Repeats interleave the kinds, so the machine's noise hits both alike. Round 0 warms
        # up (the async stager allocates its CPU buffers on its first save, the process mode
        # spawns its writer).
        for r in range(args.repeats + 1):
            row = {"base": statistics.median(step(model, optimizer, scheduler, x) for _ in range(3))}
            for kind, ckpt in managers.items():
                settle()
                t0 = time.perf_counter()
                ckpt.save(r + 1)
                row[f"{kind}_call"] = time.perf_counter() - t0
                extra, n = 0.0, 0
                while ckpt.saving:
                    extra += step(model, optimizer, scheduler, x) - row["base"]
                    n += 1
                ckpt.wait()
                row[f"{kind}_overlap"], row[f"{kind}_steps"] = max(0.0, extra), n
                manifest = json.loads((ckpt.run.checkpoint_dir(r + 1) / MANIFEST).read_text())
                row[f"{kind}_seconds"] = manifest["save_seconds"]
                row["bytes"] = sum(f["size"] for f in manifest["files"].values())
            settle()
            row["dd"] = dd_seconds(folder, row["bytes"])
            if r:
                rows.append(row)
        for ckpt in managers.values():
            ckpt.close()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    def med_ratio(num, den) -> float:
        """Median over rounds of a ratio of one round's figures (neighbours in time share the noise)."""
        return statistics.median(num(row) / den(row) for row in rows)

    nbytes = med("bytes")
    print(f"state {state_bytes / 1e6:.0f} MB, checkpoint {nbytes / 1e6:.0f} MB, step {med('base') * 1000:.0f} ms,"
          f" {len(rows)} rounds of (sync save, async save, process save, dd); medians")
    print(f"blocked by a sync save       {med('sync_call'):.3f} s")
    print(f"blocked by an async save     {med('async_call'):.3f} s   (the save() call: wait for the previous save,"
          " stage to CPU, start)")
    print(f"async / sync blocked         {med_ratio(lambda r: r['async_call'], lambda r: r['sync_call']):.3f}"
          "   (target <= 0.10)")
    print(f"async background write      {med('async_seconds'):.3f} s to the committed manifest, overlapping"
          f" {med('async_steps'):.0f} steps that ran {med('async_overlap'):.3f} s slower in total")
    both = med_ratio(lambda r: r["async_call"] + r["async_overlap"], lambda r: r["sync_call"])
    print(f"(async blocked + slowdown of overlapping steps) / sync blocked   {both:.3f}   (async_mode=thread)")
    print(f"blocked by a process save    {med('process_call'):.3f} s   (async_mode=process)")
    print(f"process background write    {med('process_seconds'):.3f} s to the committed manifest, overlapping"
          f" {med('process_steps'):.0f} steps that ran {med('process_overlap'):.3f} s slower in total")
    both = med_ratio(lambda r: r["process_call"] + r["process_overlap"], lambda r: r["sync_call"])
    print(f"(process blocked + slowdown of overlapping steps) / sync blocked {both:.3f}   (async_mode=process;"
          " target <= 0.10)")
    print(f"save throughput              {nbytes / med('sync_seconds') / 1e6:.0f} MB/s"
          " (sync save: DCP write with CRC-32 on the way + fsync + manifest)")
    print(f"dd throughput                {nbytes / med('dd') / 1e6:.0f} MB/s (dd bs=8M conv=fsync, same folder, same bytes)")
    print(f"save / dd                    {med_ratio(lambda r: r['dd'], lambda r: r['sync_seconds']):.3f}"
          "   (target >= 0.80)")


def load_main(args) -> None:
    model, optimizer, scheduler = build(args.state_mb)
    x = torch.randn(args.batch, DIM)
    for _ in range(2):
        step(model, optimizer, scheduler, x)
    folder = Path(tempfile.mkdtemp(prefix="dtk-load-bench-", dir=args.dir or Path.cwd()))
    rows = []
    try:
        run = RunDir(folder / "run")
        run.path.mkdir()
        ckpt = manager(run, [(model, optimizer)], scheduler, asynchronous=False)
        ckpt.save(1)
        ckpt.close()
        plain = folder / "plain.pt"
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, plain)
        nbytes = sum(p.stat().st_size for p in run.checkpoint_dir(1).iterdir())
        for r in range(args.repeats + 1):  # round 0 warms the page cache and the code paths
            fresh, fresh_opt, fresh_sched = build(args.state_mb)
            fresh_opt.step()  # the optimizer's state exists, as in a worker before its resume
            resumer = manager(RunDir(run.path), [(fresh, fresh_opt)], fresh_sched, asynchronous=False)
            t0 = time.perf_counter()
            assert resumer.resume() == 1
            verified = time.perf_counter() - t0
            resumer.close()
            t0 = time.perf_counter()
            state = torch.load(plain, map_location="cpu", weights_only=True)
            torch_load = time.perf_counter() - t0
            fresh.load_state_dict(state["model"])
            fresh_opt.load_state_dict(state["optim"])
            fresh_sched.load_state_dict(state["scheduler"])
            applied = time.perf_counter() - t0
            if r:
                rows.append({"dtk": verified, "torch_load": torch_load, "plain": applied})
            del state, fresh, fresh_opt, fresh_sched, resumer
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    ratio = statistics.median(row["dtk"] / row["plain"] for row in rows)
    ratio_load = statistics.median(row["dtk"] / row["torch_load"] for row in rows)
    print(f"checkpoint {nbytes / 1e6:.0f} MB, {len(rows)} rounds, medians (page cache warm)")
    print(f"dtk verified load            {med('dtk'):.3f} s   (resume(): manifest, sizes, DCP load with CRC-32 of"
          " every file, state applied)")
    print(f"torch.load + load_state_dict {med('plain'):.3f} s")
    print(f"torch.load alone             {med('torch_load'):.3f} s")
    print(f"verified / (torch.load + load_state_dict)   {ratio:.3f}")
    print(f"verified / torch.load alone                 {ratio_load:.3f}")


if __name__ == "__main__":
    main()
