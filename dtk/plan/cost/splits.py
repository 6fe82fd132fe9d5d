"""The axes the planner's search adds to its data-, tensor- and pipeline-parallel layouts:
context parallelism (cp) for a long sequence, expert parallelism (ep) for a mixture of
experts, each from the axis table (dtk.plan.degrees), with the degrees it tries for a model.
Pure, no torch."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from dtk.config.choices import DataParallel
from dtk.plan.degrees import Axis, CarvedAxis, Degrees
from dtk.plan.shape import ModelShape

DEGREE_AXES = (*Axis, *CarvedAxis)
"""Every degree key: the grid's axes and those carved out of them (dtk.plan.degrees)."""
SPLIT_FROM = 16384
"""Sequence length from which context parallelism (cp) is searched: below it the activations
of a micro-batch of one sample rarely decide what fits, and the search stays as quick."""


def degrees_of(keys: dict[str, Any]) -> Degrees:
    """The degrees a scheme's keys set, one per axis (a carved one 1 when not set)."""
    return Degrees(**{axis.value: keys.get(axis.value, 1) for axis in DEGREE_AXES})


def _cp_degrees(shape: ModelShape, powers: list[int]) -> list[int]:
    """Context parallelism for a long sequence (from SPLIT_FROM tokens)."""
    return powers if (shape.seq_len or 0) >= SPLIT_FROM else []


def _ep_degrees(shape: ModelShape, powers: list[int]) -> list[int]:
    """Expert parallelism for a mixture of experts: degrees that divide its expert count."""
    experts = next((t.shape[0] for t in shape.tensors if t.expert), 0)
    return [p for p in powers if experts and experts % p == 0]


SPLIT_AXES: dict[Axis | CarvedAxis, Callable[[ModelShape, list[int]], list[int]]] = {
    Axis.cp: _cp_degrees, CarvedAxis.ep: _ep_degrees}
"""The axes the search adds to its dp / tp / pp layouts, each with the degrees (powers of two
inside a node) it tries for a model; the scheme's checks refuse what does not run."""


def splits(shape: ModelShape, tasks_per_node: int) -> list[dict[str, int]]:
    """Every combination of the SPLIT_AXES' degrees other than all ones."""
    powers = [2**k for k in range(1, 8) if 2**k <= tasks_per_node]
    options = [[1, *rule(shape, powers)] for rule in SPLIT_AXES.values()]
    names = [axis.value for axis in SPLIT_AXES]
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*options) if math.prod(combo) > 1]


def split_layouts(tpn: int, world: int, max_tp: int, splits: list[dict[str, int]], *,
                  max_pp: int = 1) -> list[tuple[str, dict[str, Any]]]:
    """FSDP layouts with the searched split axes (`Search.splits`: cp, ep) beside tp, each
    split and tp inside a node; cp also under a pipeline of up to `max_pp` stages (ep runs
    without one)."""
    out: list[tuple[str, dict[str, Any]]] = []
    grid = set(Axis.values())
    for split in splits:
        used = math.prod(v for k, v in split.items() if k in grid)  # what the grid's split axes take of the world
        pipelined = split[CarvedAxis.ep.value] == 1  # every split names each SPLIT_AXES axis
        for tp in range(1, min(tpn, max_tp) + 1):
            if tp & (tp - 1) or tpn % (tp * used) or world % (tp * used):
                continue
            rest = world // (tp * used)
            stages = [p for p in range(1, min(rest, max_pp) + 1) if rest % p == 0] if pipelined else [1]
            for pp in stages:
                d = Degrees(dp_replicate=1, pp=pp, dp_shard=rest // pp, tp=tp, **split)
                out.append(("hybrid", {**{a.value: d.of(a) for a in DEGREE_AXES}, "sequence_parallel": False,
                                       "data_parallel": DataParallel.fsdp}))
    return out
