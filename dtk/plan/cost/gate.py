"""The memory check before the queue: dtk.submit plans every job's memory and refuses one
that cannot fit (exit 2), with the numbers and the smallest node count (and scheme) that
fits; `submit.force=true` submits anyway. No torch (a user `_target_` model is counted in
a subprocess, dtk.plan.count_model)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtk.config.schema import Config
from dtk.plan.cost.budget import ORDER
from dtk.plan.cost.report import MemoryPlan, gb
from dtk.plan.plan import Plan


@dataclass(frozen=True)
class Checked:
    budget: MemoryPlan | None
    """None when the model could not be counted (then nothing is judged)."""
    refusal: str | None
    """The one-line reason the job cannot fit; None when it fits, is not judged, or is forced."""
    note: str | None = None
    """Why the budget was not judged, to print before submitting."""


def budget_of(cfg: Config, plan: Plan, config_dirs: tuple[Path, ...] = ()) -> MemoryPlan:
    from dtk.plan.cost.inputs import context
    from dtk.plan.cost.report import memory_plan

    return memory_plan(context(cfg, plan, config_dirs=config_dirs), plan)


def smallest(mp: MemoryPlan) -> str:
    """The smallest node count that fits: with the job's scheme, and with any scheme when
    another fits on fewer."""
    parts = []
    if mp.min_nodes:
        parts.append(f"nodes={mp.min_nodes} with this scheme ({mp.key})")
    sized = sorted((r.min_nodes, ORDER.index(k), k) for k, r in mp.rows.items() if r.min_nodes)
    if sized and (not mp.min_nodes or sized[0][0] < mp.min_nodes):
        nodes, _, key = sized[0]
        row = mp.rows[key]
        overrides = row.estimate.variant.overrides if row.estimate else [f"+scheme={key}"]
        parts.append(f"nodes={nodes} with {' '.join(overrides)}")
    if not parts:
        return "no scheme fits on any node count tried (up to 4096 nodes)"
    return "smallest that fits: " + "; ".join(parts)


def refusal(mp: MemoryPlan) -> str:
    b, v, ctx = mp.chosen.bytes, mp.chosen.variant, mp.ctx
    parts = " + ".join(f"{k} {gb(getattr(b, k))}" for k in ("params", "grads", "optimizer", "activations", "buffers",
                                                             "margin"))
    text = (f"the job does not fit: {gb(b.total)} GB per device under {mp.key} on {v.nodes} node(s) x"
            f" {v.tasks_per_node} = {parts} GB > {gb(ctx.capacity)} GB ({ctx.capacity_source}); {smallest(mp)}")
    r = mp.recommended
    if r.scheme:
        text += f"; recommended: {' '.join(r.overrides)}"
    return text + "; submit.force=true submits anyway (python -m dtk.plan shows the whole budget)"


def memory_tier_refusal(cfg: Config, mp: MemoryPlan) -> str | None:
    """checkpoint.memory_every: why the tier's host memory (own shard + a partner's replica, the two
    newest steps) does not fit a node's RAM with what the workers hold there; None when it fits."""
    if not cfg.checkpoint.memory_every or mp.chosen is None:
        return None
    import os

    from dtk.plan.cost.search import HOST_NODE_BYTES

    b, ctx = mp.chosen.bytes, mp.ctx
    if cfg.cluster.mem_gb:
        node, source = cfg.cluster.mem_gb * 2**30, f"cluster.mem_gb={cfg.cluster.mem_gb}"
    elif cfg.cluster.kind == "local":
        node, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    else:
        node, source = HOST_NODE_BYTES, "a node's host memory assumed (cluster.mem_gb unset)"
    tier = ctx.tasks_per_node * 4 * (b.params + b.optimizer)
    need = ctx.tasks_per_node * (b.host + (b.total if ctx.device == "cpu" else 0))
    if need <= node:
        return None
    return (f"checkpoint.memory_every={cfg.checkpoint.memory_every}: the in-memory snapshot tier needs {gb(tier)} GB"
            f" of host memory per node (own shard + replica, two steps), {gb(need)} GB with the workers' own, more"
            f" than {gb(node)} GB ({source}); shard the state (+scheme=fsdp) or checkpoint.memory_every=0")


def check(cfg: Config, plan: Plan, config_dirs: tuple[Path, ...] = ()) -> Checked:
    """The job's budget and, when it does not fit and is not forced, why it is refused."""
    from dtk.plan.count_model import NotCounted

    try:
        mp = budget_of(cfg, plan, config_dirs)
    except NotCounted as exc:
        return Checked(None, None, f"memory not checked: {exc}")
    if mp.fits is False and not cfg.submit.force:
        return Checked(mp, refusal(mp))
    tier = memory_tier_refusal(cfg, mp)
    if tier:
        return Checked(mp, tier)
    note = None
    if mp.fits is False:
        note = f"submit.force=true: submitting although {refusal(mp).split(';')[0]}"
    return Checked(mp, None, note)


def planned_memory(cfg: Config, plan: Plan, checked: Checked) -> dict[str, Any]:
    """plan.json's `memory` (dtk.plan.planned_memory): every rank's planned bytes of the job
    as it trains (no plan.* keys), on the device the plan expects and, with dist.device=auto,
    on the other kind too (a worker takes a GPU when it sees one). Made here once, so the
    workers compare their measurement with these figures instead of running the budget."""
    from dtk.plan.cost.memory import rank_bytes
    from dtk.plan.cost.predict import describe_error, figures
    from dtk.plan.cost.report import chosen_variant
    from dtk.plan.layout import RankClasses, uses_fsdp, uses_zero1

    mp = checked.budget
    if mp is None:
        return {"error": checked.note or "the model could not be counted"}
    kinds = [mp.ctx.device] + ([k for k in ("cuda", "cpu") if k != mp.ctx.device] if cfg.dist.device == "auto" else [])
    devices: dict[str, Any] = {}
    try:
        for kind in kinds:
            ctx = dataclasses.replace(mp.ctx, device=kind, plan_keys={})
            job = ctx.job(chosen_variant(ctx, plan))
            table: list[dict[str, int]] = []
            of_rank = []
            of_class: dict[tuple[int, ...], int] = {}  # a budget per class of ranks, not per rank
            classes = RankClasses(ctx.shape, job.degrees, fsdp=uses_fsdp(job.scheme, job.degrees),
                                  zero1=uses_zero1(job.scheme, job.degrees))
            for rank in range(plan.world_size):
                key = classes.of(rank)
                if key not in of_class:
                    f = figures(rank_bytes(ctx.shape, job, rank))
                    if f not in table:
                        table.append(f)
                    of_class[key] = table.index(f)
                of_rank.append(of_class[key])
            devices[kind] = {"figures": table, "of_rank": of_rank}
    except Exception as exc:  # a model the budget cannot lay out: the run goes on, the reason recorded
        return {"error": describe_error(exc)}
    return {"world": plan.world_size, "tasks_per_node": plan.tasks_per_node,
            "degrees": dataclasses.asdict(plan.degrees), "activations_estimated": mp.ctx.shape.has_activation_shape,
            "devices": devices}
