"""The doctor's all-reduce figures next to a plain torch.distributed all-reduce loop, on the
same ranks and group, in the same processes.

    doctor   dtk.doctor.measure.all_reduce_sweep: per size a warm-up, then `repeats` timed
             batches (each after a barrier, back-to-back all-reduces filling about 25 ms,
             per all-reduce), the slowest rank's median
    plain    what one writes by hand (nccl-tests' way): one warm-up, then `repeats`
             all-reduces back to back, total / repeats on each rank, the slowest rank's

Rounds alternate which goes first. For each size the figure is the median over rounds of
doctor algbw / plain algbw (1.0: the doctor reports the bandwidth a plain loop sees; below:
its barriers and per-call timing cost bandwidth that is not the fabric's).

    python benchmarks/doctor_allreduce.py --ranks 2 --max-mb 64 --repeats 5 --rounds 5
    srun -p debug -N 2 -n 2 python benchmarks/doctor_allreduce.py --max-mb 64   (lab: one rank per node;
        on a lab with --netns, GLOO_SOCKET_IFNAME=lab0 in srun's environment, as dtk's fabric sets it)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtk.doctor.measure import MB, all_reduce_sweep  # noqa: E402


def plain_loop(size_mb: float, repeats: int) -> float:
    buf = torch.ones(int(size_mb * MB) // 4)
    dist.all_reduce(buf)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buf)
    mine = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return size_mb * MB / float(mine.item()) / 1e9


def bench(args) -> None:
    sizes, size = [], args.min_mb
    while size <= args.max_mb:
        sizes.append(size)
        size *= 4
    world = dist.get_world_size()
    ratios: dict[float, list[float]] = {s: [] for s in sizes}
    doctor_bw: dict[float, list[float]] = {s: [] for s in sizes}
    plain_bw: dict[float, list[float]] = {s: [] for s in sizes}
    for round_ in range(args.rounds):
        for s in sizes:
            order = ("doctor", "plain") if round_ % 2 == 0 else ("plain", "doctor")
            got = {}
            for which in order:
                if which == "doctor":
                    (row,) = all_reduce_sweep(group=None, group_size=world, sizes=[s], repeats=args.repeats,
                                              device=torch.device("cpu"))
                    got["doctor"] = row.algbw_gbs
                else:
                    got["plain"] = plain_loop(s, args.repeats)
            doctor_bw[s].append(got["doctor"])
            plain_bw[s].append(got["plain"])
            ratios[s].append(got["doctor"] / got["plain"])
    if dist.get_rank() == 0:
        print(f"world {world}, gloo on the CPU, {args.repeats} repeats x {args.rounds} rounds")
        print("| size MB | doctor algbw GB/s | plain algbw GB/s | doctor / plain |")
        print("| ---: | ---: | ---: | ---: |")
        for s in sizes:
            print(f"| {s:g} | {statistics.median(doctor_bw[s]):.3f} | {statistics.median(plain_bw[s]):.3f}"
                  f" | {statistics.median(ratios[s]):.3f} |")


def _entry(rank: int, args, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        bench(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="local ranks (ignored under srun)")
    parser.add_argument("--min-mb", type=float, default=1.0)
    parser.add_argument("--max-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if "SLURM_PROCID" in os.environ:  # one rank of an srun step
        from dtk.worker.env import read_env

        env = read_env()
        port = 20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{port}", rank=env.rank,
                                world_size=env.world_size)
        try:
            bench(args)
        finally:
            dist.destroy_process_group()
        return
    from dtk.driver.local import free_port

    mp.start_processes(_entry, args=(args, args.ranks, free_port()), nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main()
