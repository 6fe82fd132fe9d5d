"""Each rank's planned memory as the plan hands it to the workers (plan.json's `memory`), and
how a worker holds its measurement against it. The figures are the budget's
(dtk.plan.cost.memory, made at submission by dtk.plan.cost.gate.planned_memory); this module reads and
compares them only, so a worker's import path holds no budget (dtk.plan.cost.predict says what
each device's measurement sees).

plan.json's `memory` is `{"error": why}` when no figures could be made, else
`{"world", "tasks_per_node", "degrees", "activations_estimated", "devices": {device kind:
{"figures": [distinct figures], "of_rank": [index into figures, one per rank]}}}`.
"""

from __future__ import annotations

from typing import Any

MISMATCH = 0.10
"""Largest gap between measured and predicted bytes, as a share of the prediction, that is not an event."""

FIGURES = ("params", "grads", "optimizer", "activations", "buffers", "margin", "total", "activations_saved",
           "gathered_kept")
"""One rank's planned bytes by kind, as plan.json holds them (dtk.plan.cost.memory.RankBytes's)."""


def for_rank(memory: dict[str, Any] | None, *, rank: int, device: str, world: int, tasks_per_node: int,
             degrees: dict[str, int]) -> tuple[dict[str, int] | None, str | None]:
    """This rank's planned figures, or None and why there are none: no figures handed over,
    or figures of another world or device than this start's."""
    if memory is None:
        return None, ("no planned memory in this start's plan (made at submission; a plan the driver made again for"
                      " other nodes has none)")
    if "error" in memory:
        return None, memory["error"]
    planned = (memory["world"], memory["tasks_per_node"], memory["degrees"])
    if planned != (world, tasks_per_node, degrees):
        return None, (f"the memory was planned for world {memory['world']} ({memory['tasks_per_node']} per node);"
                      f" this start runs world {world} ({tasks_per_node} per node)")
    table = memory["devices"].get(device)
    if table is None:
        return None, f"the memory was planned for {', '.join(memory['devices'])}; this rank runs on {device}"
    return table["figures"][table["of_rank"][rank]], None


def comparable(figures: dict[str, int], device: str) -> int:
    """The part of a prediction that the device's measurement sees (dtk.plan.cost.predict's module doc)."""
    states = figures["params"] + figures["grads"] + figures["optimizer"]
    if device == "cuda":
        return states + figures["activations"] + figures["buffers"]
    return states + figures["activations_saved"] + figures["gathered_kept"]


def rank_record(figures: dict[str, int], measured: dict[str, int | None], *, rank: int, device: str,
                activations_estimated: bool) -> dict[str, Any]:
    """One rank's prediction against its measurement, for summary.json."""
    predicted = comparable(figures, device)
    total = measured.get("total")
    shown = ("params", "grads", "optimizer", "activations", "buffers", "margin", "total", "activations_saved")
    return {
        "rank": rank,
        "predicted_bytes": predicted,
        "measured_bytes": total,
        "gap": None if total is None or not predicted else round(total / predicted - 1, 4),
        "predicted": {k: figures[k] for k in shown},
        "measured": measured,
        "activations_estimated": activations_estimated,
    }


def summarize(ranks: list[dict[str, Any]], *, device: str) -> dict[str, Any]:
    """summary.json's `memory`: the largest rank's figures, every rank's, and the ranks whose
    gap is above MISMATCH."""
    worst = max(ranks, key=lambda r: r["measured_bytes"] or 0)
    off = [r for r in ranks if r["gap"] is not None and abs(r["gap"]) > MISMATCH]
    return {
        "device": device,
        "basis": "max_memory_allocated" if device == "cuda" else "live tensors: states + kept for backward (one step)",
        "rank": worst["rank"],
        "predicted_bytes": worst["predicted_bytes"],  # that rank's plan: like against like
        "measured_bytes": worst["measured_bytes"],
        "gap": worst["gap"],
        "mismatch_ranks": [r["rank"] for r in off],
        "ranks": ranks,
    }


def mismatch_event(memory: dict[str, Any]) -> dict[str, Any] | None:
    """The `plan_mismatch` event's fields, or None when every rank is within MISMATCH."""
    off = [r for r in memory["ranks"] if r["rank"] in memory["mismatch_ranks"]]
    if not off:
        return None
    r = max(off, key=lambda x: abs(x["gap"]))
    why = "" if r["activations_estimated"] else " (activations of this model are not estimated)"
    return {
        "rank": r["rank"], "predicted_bytes": r["predicted_bytes"], "measured_bytes": r["measured_bytes"],
        "gap": r["gap"], "ranks": [x["rank"] for x in off], "limit": MISMATCH,
        "detail": f"rank {r['rank']} measured {r['measured_bytes'] / 1e9:.3f} GB against {r['predicted_bytes'] / 1e9:.3f}"
                  f" GB planned ({r['gap']:+.0%}, limit {MISMATCH:.0%}){why}",
    }
