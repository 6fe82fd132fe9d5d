"""The doctor's measurements, on a started process group. Every rank calls each function
(they are collective); each returns plain numbers, the same on every rank where it says so.

All-reduce figures follow nccl-tests (doc/PERFORMANCE.md there): for a message of S bytes
taking t seconds, algorithm bandwidth algbw = S / t, and bus bandwidth busbw = algbw *
2 (n - 1) / n for n ranks, the share each link carries in a ring, which makes busbw
comparable across rank counts and with the link's speed. t is the slowest rank's median
of the timed repeats (a collective ends when its last rank ends).

Each timed repeat is, as in nccl-tests, a batch of back-to-back all-reduces started
together after a barrier, divided by its count. A batch holds as many as fill about
BATCH_S (one for a message that takes longer), the same count on every rank. Timing one
all-reduce alone after a barrier would add the barrier's release skew (the first rank out
starts its clock while the last is still inside) to every sample: negligible for large
messages, but for a 1 MB message on gloo (about 2 ms) it cost 20% of the bandwidth a
plain back-to-back loop sees (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

MB = 1_000_000
BATCH_S = 0.025
"""A timed batch of all-reduces lasts about this long: long enough to spread the barrier's
skew (tens to hundreds of microseconds) below 1%, short enough for a quick sweep."""
MAX_BATCH = 64


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class AllReduceRow:
    size_mb: float
    time_ms: float
    algbw_gbs: float
    busbw_gbs: float


def batch_size(seconds: float) -> int:
    """How many all-reduces of `seconds` each fill a timed batch (module doc)."""
    return max(1, min(MAX_BATCH, math.ceil(BATCH_S / max(seconds, 1e-6))))


def time_all_reduce(buf: torch.Tensor, *, group, repeats: int, device: torch.device) -> float:
    """Median seconds of one all-reduce of `buf` on this rank: after a warm-up, `repeats`
    timed batches of back-to-back all-reduces (module doc), per all-reduce."""
    dist.all_reduce(buf, group=group)
    _sync(device)
    start = time.perf_counter()  # a second warm-up, timed: how many make a batch
    dist.all_reduce(buf, group=group)
    _sync(device)
    count = torch.tensor([batch_size(time.perf_counter() - start)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)  # every rank runs the same batches
    num = int(count.item())
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        for _ in range(num):
            dist.all_reduce(buf, group=group)
        _sync(device)
        times.append((time.perf_counter() - start) / num)
    return statistics.median(times)


def all_reduce_sweep(*, group, group_size: int, sizes: list[float], repeats: int, device: torch.device) -> list[AllReduceRow]:
    """Collective over `group` (its members call it; the slowest member's time counts)."""
    rows = []
    for size in sizes:
        buf = torch.ones(int(size * MB) // 4, dtype=torch.float32, device=device)
        mine = torch.tensor([time_all_reduce(buf, group=group, repeats=repeats, device=device)], dtype=torch.float64,
                            device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        seconds = float(mine.item())
        algbw = size * MB / seconds / 1e9
        rows.append(AllReduceRow(size, seconds * 1e3, algbw, algbw * 2 * (group_size - 1) / group_size))
        del buf
    return rows


def p2p_matrix(*, leaders: list[int], size_mb: float, repeats: int, device: torch.device) -> dict[tuple[int, int], float]:
    """GB/s from node i to node j (i != j) between the nodes' first ranks: i sends S bytes,
    j answers with one number; the median of `repeats` times at i. Collective over the world;
    the answer is complete on the first rank of each sending node (others get {})."""
    rank = dist.get_rank()
    out: dict[tuple[int, int], float] = {}
    payload = torch.ones(int(size_mb * MB) // 4, dtype=torch.float32, device=device)
    ack = torch.zeros(1, dtype=torch.float32, device=device)
    for i, src in enumerate(leaders):
        for j, dst in enumerate(leaders):
            if i == j:
                continue
            times = []
            for k in range(repeats + 1):  # the first is a warm-up (connection set-up)
                dist.barrier()
                if rank == src:
                    start = time.perf_counter()
                    dist.send(payload, dst)
                    dist.recv(ack, dst)
                    _sync(device)
                    if k:
                        times.append(time.perf_counter() - start)
                elif rank == dst:
                    dist.recv(payload, src)
                    dist.send(ack, src)
            if rank == src:
                out[(i, j)] = size_mb * MB / statistics.median(times) / 1e9
    return out


def matmul_tflops(*, n: int, repeats: int, device: torch.device) -> float:
    """This device's throughput on an n x n x n float32 matrix multiply (2 n^3 flops):
    the median of `repeats` timed batches of back-to-back multiplies, each filling about
    BATCH_S (a single small multiply takes microseconds, below a busy machine's noise)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    torch.mm(a, b)
    _sync(device)
    start = time.perf_counter()
    torch.mm(a, b)
    _sync(device)
    num = batch_size(time.perf_counter() - start)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(num):
            torch.mm(a, b)
        _sync(device)
        times.append((time.perf_counter() - start) / num)
    return 2 * n**3 / statistics.median(times) / 1e12


def gather_to_zero(value):
    """Every rank's value on rank 0 (a list, rank order); None elsewhere."""
    out: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def rows_dict(rows: list[AllReduceRow]) -> list[dict]:
    return [asdict(r) for r in rows]
