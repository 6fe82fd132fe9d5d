"""`python -m dtk.bench matmul`: the matmul rate of this machine's device at the GEMM widths
of a transformer's tensor-parallel slices, for the planner's step time.

A transformer block's matmuls multiply the micro-batch's tokens by weights whose split
dimension is hidden / tp on each rank: narrow slices run below the device's peak, wide ones
near it. This measures `tokens x width @ width x 4 width` (the feed-forward's shape) at each
width, in bf16 on a GPU (float32 on the CPU: it measures the CPU), and writes one JSON file
per host, `matmul-HOST.json`, into the folder given. Run it on each node (`srun -N NODES
--ntasks-per-node=1 python -m dtk.bench matmul --out DIR`); `cluster.matmul_rates=DIR` hands
the folder to the planner, which takes the slowest node's rate at each width
(dtk.plan.cost.steptime.matmul_shares).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

WIDTHS = (256, 512, 1024, 2048, 4096, 8192)
CPU_WIDTHS = (64, 128, 256, 512)
"""The CPU is far slower: smaller widths keep the command short."""
TOKENS = 4096


def _rate(torch: Any, width: int, *, device: Any, dtype: Any, tokens: int, repeats: int) -> float:
    """TFLOP/s of `tokens x width @ width x 4 width`, the median of `repeats` timed runs."""
    a = torch.randn(tokens, width, device=device, dtype=dtype)
    b = torch.randn(width, 4 * width, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):  # warm-up: kernels chosen, caches filled
        torch.mm(a, b)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return 2.0 * tokens * width * 4 * width / times[len(times) // 2] / 1e12


def measure(widths: tuple[int, ...] | None = None) -> dict[str, Any]:
    """The rates of this machine's first device (the CPU without a GPU)."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = TOKENS if cuda else 256
    rows = [{"width": w, "tflops": round(_rate(torch, w, device=device, dtype=dtype, tokens=tokens,
                                                    repeats=20 if cuda else 3), 6)}
            for w in (widths or (WIDTHS if cuda else CPU_WIDTHS))]
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return {"host": socket.gethostname(), "device": name, "dtype": str(dtype).removeprefix("torch."),
            "tokens": tokens, "rows": rows}


def write(result: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"matmul-{result['host']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def render(result: dict[str, Any]) -> str:
    lines = [f"{result['host']}: {result['device']} ({result['dtype']}, {result['tokens']} tokens x width @ width x 4 width)"]
    widest = result["rows"][-1]["tflops"]
    lines += [f"  width {r['width']:6d}: {r['tflops']:9.3f} TFLOP/s ({r['tflops'] / widest:.0%} of the widest)"
              for r in result["rows"]]
    return "\n".join(lines)
