"""What the doctor concludes from its figures, and how it writes them down. No torch.

A node is slow when one of its figures is worse than the median of all nodes' by more
than doctor.slow_factor. Each direction is judged on its own, never pooled:

    sending     what it sends to the other nodes (a link slowed on its way out, as `tc`
                on the node's egress does): the upper median of its transfers out, so one
                slow link of another node's does not drag it down, while a slow egress,
                which slows every transfer out, does
    receiving   what it receives from the others, the same way (3 nodes or more: with two,
                what one receives is what the other sends, and the sender is the one
                judged)
    matmul      the median matrix-multiply throughput of its devices

And each link: one slower than the median of all links by slow_factor that neither end's
direction explains (a bad cable or port between two nodes) is listed as a slow link, not
blamed on either node. With two nodes the median is their mean, so a node must be far off
(slow_factor x below the mean) to be flagged; the more nodes, the sharper the test.
"""

from __future__ import annotations

import statistics
from pathlib import Path

RESULTS = "doctor.json"
REPORT = "report.md"
EXCLUDE = "exclude.txt"


def _links(results: dict) -> dict[tuple[str, str], float]:
    return {tuple(pair.split("->")): bw for pair, bw in results.get("p2p_gbs", {}).items()}


def per_node_figures(results: dict) -> dict[str, dict[str, float]]:
    names = [n["node"] for n in results["nodes"]]
    figures: dict[str, dict[str, float]] = {n: {} for n in names}
    links = _links(results)
    for name in names:
        sent = [bw for (src, _), bw in links.items() if src == name]
        received = [bw for (_, dst), bw in links.items() if dst == name]
        if sent:
            figures[name]["sending GB/s"] = statistics.median_high(sent)
        if received and len(names) > 2:
            figures[name]["receiving GB/s"] = statistics.median_high(received)
        flops = results.get("matmul_tflops", {}).get(name)
        if flops:
            figures[name]["matmul TFLOP/s"] = statistics.median(flops)
    return figures


def slow_links(results: dict, *, slow_factor: float, flagged: list[dict]) -> list[str]:
    """Links slower than the median link by more than slow_factor whose sender was not
    flagged for sending nor its receiver for receiving: the link itself is slow."""
    links = _links(results)
    if len(links) < 3:  # two nodes: each link is one node's sending, judged there
        return []
    median = statistics.median(links.values())
    why = {f["node"]: f["why"] for f in flagged}
    return [f"{src}->{dst} {bw:.3g} GB/s is {median / bw:.1f}x below the median link {median:.3g}"
            f" (doctor.slow_factor={slow_factor:g})"
            for (src, dst), bw in links.items()
            if bw * slow_factor < median and "sending" not in why.get(src, "") and "receiving" not in why.get(dst, "")]


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
    if results.get("slow_links"):
        lines += ["## Slow links (neither end slow in that direction)", ""]
        lines += [f"- {link}" for link in results["slow_links"]] + [""]
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
