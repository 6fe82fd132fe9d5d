"""plan.md (written at submission) against mesh.json (the mesh the workers built): the same
rank placement on nodes and the same members in every group of every mesh axis."""

from __future__ import annotations

import json
import re
from pathlib import Path


def planned_mesh(text: str) -> tuple[dict[int, int], dict[str, set[tuple[int, ...]]]]:
    """(rank -> node, axis -> groups) as plan.md states them."""
    nodes: dict[int, int] = {}
    section = text.split("### Ranks per node", 1)[1].split("### Groups", 1)[0]
    for m in re.finditer(r"^\| (\d+) \| ([\d, -]+) \|$", section, flags=re.M):
        for part in m.group(2).split(", "):
            lo, _, hi = part.partition("-")
            for rank in range(int(lo), int(hi or lo) + 1):
                nodes[rank] = int(m.group(1))
    groups: dict[str, set[tuple[int, ...]]] = {}
    block = text.split("### Groups", 1)[1].split("\n## ", 1)[0]
    for m in re.finditer(r"^- (\w+) \(size \d+, [a-z ]+\): (.*)$", block, flags=re.M):
        groups[m.group(1)] = {tuple(int(x) for x in g.split(", ")) for g in re.findall(r"\[([\d, ]+)\]", m.group(2))}
    return nodes, groups


def assert_plan_md_matches_mesh(run: Path) -> None:
    nodes, groups = planned_mesh((run / "plan.md").read_text())
    ranks = json.loads((run / "mesh.json").read_text())["ranks"]
    assert sorted(nodes) == [r["rank"] for r in sorted(ranks, key=lambda r: r["rank"])]
    hosts: dict[int, set[str]] = {}
    for r in ranks:
        assert nodes[r["rank"]] == r["node_rank"], r
        hosts.setdefault(nodes[r["rank"]], set()).add(r["host"])
    assert all(len(h) == 1 for h in hosts.values()), hosts  # one planned node, one machine
    assert len({h for hs in hosts.values() for h in hs}) == len(hosts) or len(hosts) == 1, hosts
    built = {axis: {tuple(r["groups"][axis]) for r in ranks} for axis in {a for r in ranks for a in r["groups"]}}
    assert built == groups, (built, groups)
