"""Fit a plan to the nodes a job still has: the same run on fewer nodes, or no plan."""

from __future__ import annotations

import copy
from pathlib import Path

from dtk.errors import UserError
from dtk.plan.plan import Plan, make_plan


def fit_plan(plan: Plan, usable_nodes: int, *, allow_shrink: bool) -> Plan | None:
    """`plan` when enough nodes are usable; else the plan on `usable_nodes` nodes with the
    same global batch (more accumulation, or a smaller micro batch), when the scheme's
    degrees allow it; else None (the job must requeue)."""
    if usable_nodes >= plan.nodes:
        return plan
    if not allow_shrink or usable_nodes < 1:
        return None
    cfg = copy.deepcopy(plan.config)
    cfg.nodes = usable_nodes
    cfg.tasks_per_node = plan.tasks_per_node
    cfg.spare_nodes = 0
    cfg.run.root = str(Path(plan.run_dir).parent)
    cfg.run.name = plan.run_name
    # Keep the micro batch (it is what fits in memory) when it still divides the batch;
    # otherwise the largest smaller one that does.
    for micro in range(plan.micro_batch, 0, -1):
        cfg.train.micro_batch = micro
        try:
            shrunk = make_plan(cfg, import_path=plan.import_path)
        except UserError:
            continue
        assert shrunk.config_hash == plan.config_hash and shrunk.run_dir == plan.run_dir
        return shrunk
    return None
