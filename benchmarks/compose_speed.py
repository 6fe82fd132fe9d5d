"""CPU time of one `compose()` in a process that composed before: a sweep's points, a
handover's retries, a test suite. The first compose of a set of group choices builds
Hydra's defaults tree; a later one with the same choices and other values starts from it.

For each case: the median over --repeats calls of the process CPU time (time.process_time,
which the machine's load does not change), with the load average printed beside it.

    python benchmarks/compose_speed.py --repeats 21
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from dtk.config.compose import SearchPath, compose


def cpu_ms(overrides: list[str]) -> float:
    start = time.process_time()
    compose(overrides, search=SearchPath())
    return (time.process_time() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    first = cpu_ms(["+scheme=fsdp"])
    print(f"first compose of +scheme=fsdp (imports included): {first:.0f} ms CPU")
    group_steps = [cpu_ms(["+scheme=fsdp", f"+extra.point={i}", f"model.dim={64 + i}"]) for i in range(args.repeats)]
    print(f"+scheme=fsdp with other values each time: median {statistics.median(group_steps):.1f} ms CPU")
    fresh = []
    for i in range(args.repeats):
        from dtk.config import compose as compose_module

        compose_module._BASES.clear()  # the defaults tree built again every time, as before
        fresh.append(cpu_ms(["+scheme=fsdp", f"model.dim={64 + i}"]))
    print(f"+scheme=fsdp with its defaults tree built each time: median {statistics.median(fresh):.1f} ms CPU")


if __name__ == "__main__":
    main()
