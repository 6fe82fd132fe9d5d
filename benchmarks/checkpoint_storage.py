"""Checkpoint save and load throughput: local disk vs an S3-compatible object store.

One process builds a stack of Linear layers with AdamW state (parameters and two moments:
at least --state-mb) and, for each backend in the same run, saves it with dtk's Saver (a
synchronous save: DCP shards hashed as written, the small files, the manifest committed
last) and loads it back with dtk's verified load (manifest and sizes, DCP load with every
file's CRC-32 checked, the state applied). Backends:

  local   a folder on the local disk (LocalStorage: fsynced files, the manifest renamed)
  s3      a bucket of moto's S3 server on 127.0.0.1, started here (FsspecStorage through
          s3fs: one PUT per object, the manifest PUT last)

moto keeps objects in the memory of its own Python thread in this process, so the s3
figures are those of the protocol path (HTTP, s3fs, the uploads and ranged reads) on this
machine, not of a real S3 across a network: they say what the seam costs, not what a
cluster's object store gives. Medians of --repeats rounds after a warm-up round; MB/s =
bytes of the checkpoint / seconds; the ratio s3/local of the medians.

    python benchmarks/checkpoint_storage.py --state-mb 64 --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import new_bucket, s3_server  # noqa: E402
from dtk.checkpoint import load as loading  # noqa: E402
from dtk.checkpoint import sharded as ckpt  # noqa: E402
from dtk.common.rundir import CHECKPOINTS_DIR  # noqa: E402
from dtk.common.storage import LocalStorage, Storage, checkpoint_folder, open_storage  # noqa: E402


def build(state_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, round(state_mb * 2**20 / (3 * 4 * width * width)))  # params + 2 AdamW moments, fp32
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def save(folder: Storage, step: int, parts) -> float:
    saver = ckpt.Saver(ckpt.Comm(None), asynchronous=False, on_commit=lambda manifest: None)
    t0 = time.perf_counter()
    try:
        saver.start(folder, parts=parts, trainer_state={"step": step, "world_size": 1},
                    header={"step": step, "samples_consumed": step, "global_batch": 1, "world_size": 1})
    finally:
        saver.close()
    return time.perf_counter() - t0


def load(folder: Storage, parts) -> float:
    comm = ckpt.Comm(None)
    t0 = time.perf_counter()
    manifest = loading.verify(comm, folder, checksums=False)
    loading.load(folder, parts=parts, comm=comm, manifest=manifest)
    return time.perf_counter() - t0


def rounds(store: Storage, parts, repeats: int) -> tuple[list[float], list[float], int]:
    saves, loads = [], []
    nbytes = 0
    for i in range(repeats + 1):  # round 0 warms up
        folder = checkpoint_folder(store, i + 1)
        s = save(folder, i + 1, parts)
        nbytes = sum(folder.size(name) for name in folder.files())
        t = load(folder, parts)
        folder.delete()
        if i:
            saves.append(s)
            loads.append(t)
    return saves, loads, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--state-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    torch.manual_seed(0)
    parts = [build(args.state_mb)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["local"] = rounds(LocalStorage(Path(tmp) / CHECKPOINTS_DIR), parts, args.repeats)
    with s3_server():
        results["s3"] = rounds(open_storage(f"s3://{new_bucket()}/bench"), parts, args.repeats)
    print(f"torch {torch.__version__}, state {args.state_mb} MB requested, {args.repeats} rounds (medians)")
    print(f"{'backend':<8} {'bytes':>12} {'save s':>8} {'save MB/s':>10} {'load s':>8} {'load MB/s':>10}")
    med = {}
    for name, (saves, loads, nbytes) in results.items():
        s, t = statistics.median(saves), statistics.median(loads)
        med[name] = (s, t)
        print(f"{name:<8} {nbytes:>12} {s:>8.3f} {nbytes / s / 1e6:>10.1f} {t:>8.3f} {nbytes / t / 1e6:>10.1f}")
    print(f"s3/local time ratio: save {med['s3'][0] / med['local'][0]:.2f}, load {med['s3'][1] / med['local'][1]:.2f}")


if __name__ == "__main__":
    main()
