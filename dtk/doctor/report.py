"""What the doctor concludes from its figures, and how it writes them down. No torch.

A node is slow when one of its figures is worse than the median of all nodes by more than
doctor.slow_factor:

    p2p         the median bandwidth of the point-to-point transfers to and from it: a
                slow link, in either direction, slows every transfer of its node and only
                one of each other node's
    sending     with two nodes, where every transfer involves both: the bandwidth of what
                it sends (a link slowed on its way out, as `tc` on the node's egress does)
    matmul      the median matrix-multiply throughput of its devices

With two nodes the median is their mean, so a node must be far off (slow_factor x below
the mean) to be flagged; the more nodes, the sharper the test.
"""

from __future__ import annotations

import statistics
from pathlib import Path

RESULTS = "doctor.json"
REPORT = "report.md"
EXCLUDE = "exclude.txt"


def per_node_figures(results: dict) -> dict[str, dict[str, float]]:
    names = [n["node"] for n in results["nodes"]]
    figures: dict[str, dict[str, float]] = {n: {} for n in names}
    p2p = results.get("p2p_gbs", {})
    for name in names:
        ends = [pair.split("->") for pair in p2p]
        if len(names) == 2:
            mine = [bw for (src, _), bw in zip(ends, p2p.values(), strict=True) if src == name]
            kind = "sending GB/s"
        else:
            mine = [bw for (src, dst), bw in zip(ends, p2p.values(), strict=True) if name in (src, dst)]
            kind = "p2p GB/s"
        if mine:
            figures[name][kind] = statistics.median(mine)
        flops = results.get("matmul_tflops", {}).get(name)
        if flops:
            figures[name]["matmul TFLOP/s"] = statistics.median(flops)
    return figures


def analyze(results: dict, *, slow_factor: float) -> list[dict]:
    """[{node, why}] for every node slower than the median by more than slow_factor."""
    figures = per_node_figures(results)
    if len(figures) < 2:
        return []
    flagged: dict[str, list[str]] = {}
    kinds = sorted({k for f in figures.values() for k in f})
    for kind in kinds:
        values = {n: f[kind] for n, f in figures.items() if kind in f}
        median = statistics.median(values.values())
        for node, value in values.items():
            if value * slow_factor < median:
                flagged.setdefault(node, []).append(
                    f"{kind.split()[0]} {value:.3g} {kind.split()[1]} is {median / value:.1f}x below the median"
                    f" {median:.3g} (doctor.slow_factor={slow_factor:g})")
    return [{"node": n, "why": "; ".join(w)} for n, w in flagged.items()]


def exclude_text(flagged: list[dict]) -> str:
    """The list `dtk.submit cluster.exclude_from=FILE` reads: a name per line, why after #."""
    lines = ["# nodes python -m dtk.doctor found slow; use: python -m dtk.submit cluster.exclude_from=THIS_FILE"]
    lines += [f"{f['node']}  # {f['why']}" for f in flagged]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict]) -> list[str]:
    out = ["| size MB | time ms | algbw GB/s | busbw GB/s |", "| ---: | ---: | ---: | ---: |"]
    out += [f"| {r['size_mb']:g} | {r['time_ms']:.3f} | {r['algbw_gbs']:.3f} | {r['busbw_gbs']:.3f} |" for r in rows]
    return out


def render(results: dict, *, out: Path) -> str:
    names = [n["node"] for n in results["nodes"]]
    lines = [f"# dtk doctor: {len(names)} node(s) x {results['tasks_per_node']} rank(s), {results['backend']} on"
             f" {results['device']}", ""]
    flagged = results.get("flagged", [])
    if flagged:
        lines += ["## Slow nodes", ""] + [f"- **{f['node']}**: {f['why']}" for f in flagged]
        lines += ["", f"Left out of the next job by `python -m dtk.submit cluster.exclude_from={out / EXCLUDE}`.", ""]
    else:
        lines += ["No node is slower than the median by more than doctor.slow_factor.", ""]
    lines += ["## Nodes", ""]
    for n in results["nodes"]:
        ifaces = ", ".join(f"{i['name']} {i['speed_mbps'] or '?'} Mb/s {' '.join(i['ipv4']) or '-'}"
                           for i in n["interfaces"])
        ports = ", ".join(f"{p['device']}:{p['port']} {p['state']} {p['rate_gbps']:g} Gb/s" for p in n["ib_ports"])
        lines.append(f"- {n['node']}: {n['num_cpus']} CPUs, {len(n['gpus'])} GPU(s); RDMA: {ports or 'none'};"
                     f" interfaces: {ifaces or 'none'}")
    lines += ["", "## Fabric chosen", "", "```", *results["fabric"], "```", ""]
    lines += ["## All-reduce per process group", "",
              "time: the slowest rank's median; algbw = size / time; busbw = algbw x 2(n-1)/n (as nccl-tests).", ""]
    for g in results["groups"]:
        lines += [f"### {g['group']} ({g['ranks']} ranks)", "", *_table(g["rows"]), ""]
    if results.get("p2p_gbs"):
        lines += ["## Point-to-point between nodes (GB/s, first rank of each)", "",
                  "| from \\ to | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
        for a in names:
            cells = [f"{results['p2p_gbs'][f'{a}->{b}']:.3f}" if a != b else "-" for b in names]
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Matrix multiply per device (TFLOP/s)", ""]
    lines += [f"- {n}: " + ", ".join(f"{v:.3g}" for v in results["matmul_tflops"][n]) for n in names]
    figures = per_node_figures(results)
    lines += ["", "## Per node (medians the slow-node test compares)", ""]
    lines += [f"- {n}: " + ", ".join(f"{k} {v:.3g}" for k, v in f.items()) for n, f in figures.items()]
    return "\n".join(lines) + "\n"
