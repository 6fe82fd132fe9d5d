"""plan.md: the topology scheme a team hands over with a run, written into every run
directory at submission. Pure text from the plan and its memory budget; no torch.

It holds the mesh (axis sizes; which global ranks sit on which node; the groups of every
axis and whether they stay inside a node), the memory table, the traffic per axis and the
bottleneck, why this scheme, and what the plan becomes at 2x and 4x the nodes with the
same global batch. The workers record the mesh they built in mesh.json (dtk.worker.meshfile);
a test holds the two against each other.
"""

from __future__ import annotations

import dataclasses

from dtk.common.errors import UserError
from dtk.config.fabric import CHOSEN_KEYS
from dtk.config.schema import SchemeConfig
from dtk.plan.cost.budget import estimate
from dtk.plan.cost.comm import AXES, axis_groups, bottleneck, crosses_nodes, node_of, traffic
from dtk.plan.cost.report import NUM_ALTERNATIVES, MemoryPlan, gb
from dtk.plan.cost.search import why_loses
from dtk.plan.cost.variants import chosen_at
from dtk.plan.degrees import Axis, CarvedAxis, Degrees
from dtk.plan.plan import Plan
from dtk.plan.sync import describe_sync

MAX_GROUPS = 64
"""Groups listed per axis; a larger job lists the first ones and the count."""
FACTORS = (2, 4)


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def mesh_section(d: Degrees, nodes: int, tasks_per_node: int) -> list[str]:
    sizes = dataclasses.asdict(d)
    # the carved axes (expert parallelism: blocks of consecutive ranks of dp_shard x cp), when used
    drawn = [*AXES, *(a for a in CarvedAxis.values() if sizes[a] > 1)]
    lines = [
        "## Mesh",
        "",
        f"{nodes} node(s) x {tasks_per_node} worker(s) = world {d.world}; axes outermost first, a rank's coordinates"
        f" are its position in arange(world).view({', '.join(AXES)}), its node is rank // {tasks_per_node}.",
        "",
        "| axis | size | groups | stays |",
        "| --- | --- | --- | --- |",
    ]
    for axis in drawn:
        groups = axis_groups(d, axis)
        where = "crosses nodes" if crosses_nodes(d, axis, tasks_per_node) else "inside a node"
        lines.append(f"| {axis} | {sizes[axis]} | {len(groups)} | {where if sizes[axis] > 1 else '-'} |")
    lines += ["", "### Ranks per node", "", "| node | global ranks |", "| --- | --- |"]
    for node in range(nodes):
        ranks = [r for r in range(d.world) if node_of(r, tasks_per_node) == node]
        lines.append(f"| {node} | {ranks and ranges(ranks)} |")
    lines += ["", "### Groups", ""]
    for axis in drawn:
        if sizes[axis] == 1:
            continue
        groups = axis_groups(d, axis)
        where = "crosses nodes" if crosses_nodes(d, axis, tasks_per_node) else "inside a node"
        shown = " ".join(str(g) for g in groups[:MAX_GROUPS])
        more = f" ... ({len(groups)} groups in all)" if len(groups) > MAX_GROUPS else ""
        lines.append(f"- {axis} (size {sizes[axis]}, {where}): {shown}{more}")
    if all(sizes[a] == 1 for a in AXES):
        lines.append("- none: one process")
    return lines


def memory_section(mp: MemoryPlan) -> list[str]:
    ctx, b = mp.ctx, mp.chosen.bytes
    cap = f"{gb(ctx.capacity)} GB ({ctx.capacity_source})" if ctx.capacity else ctx.capacity_source
    verdict = {True: "fits", False: "DOES NOT FIT", None: "not judged"}[mp.fits]
    lines = [
        "## Memory per device",
        "",
        f"{ctx.shape.params:,} parameters ({ctx.shape.source}); device {ctx.device}, {cap}.",
        f"Largest rank: {gb(b.total)} GB under {mp.key}: {verdict}. Smallest that fits: {mp.min_devices or '-'}"
        f" device(s), {mp.min_nodes or '-'} node(s). Checkpoint: {gb(mp.checkpoint_bytes)} GB.",
        "",
        "```",
        mp.table(),
        "```",
    ]
    return lines


def traffic_section(mp: MemoryPlan) -> list[str]:
    lines = ["## Traffic per step", ""]
    if not mp.traffic:
        return lines + ["No collective traffic: one process, or every axis of size 1."]
    neck = bottleneck(mp.traffic)
    lines += ["| axis | size | GB per step per rank | links | what |", "| --- | --- | --- | --- | --- |"]
    for a in mp.traffic:
        links = "between nodes" if a.crosses_nodes else "inside a node"
        lines.append(f"| {a.axis} | {a.size} | {gb(a.bytes_per_step)} | {links} | {a.what} |")
    if neck is not None:
        lines += ["", f"Bottleneck: {neck.axis} ({gb(neck.bytes_per_step)} GB per step"
                      f" {'between nodes' if neck.crosses_nodes else 'inside a node'})."]
    return lines


def why_section(mp: MemoryPlan) -> list[str]:
    r = mp.recommended
    lines = ["## Why this scheme", ""]
    if not r.scheme:
        return lines + [f"The job runs {mp.key}; no recommendation: {r.reason}."]
    if r.scheme == mp.key:
        lines.append(f"{mp.key} is the recommended scheme: {r.reason}.")
    else:
        lines.append(f"The job runs {mp.key} as asked; the recommendation is {' '.join(r.overrides)}: {r.reason}.")
    lines += [f"- {h}" for h in r.hints]
    if mp.predicted is not None and mp.hardware is not None:
        lines += ["", f"Predicted step of the job as asked: {mp.predicted.describe()} ({mp.hardware.source})."]
    if mp.ranked:
        best = mp.ranked[0]
        lines += ["", "| | overrides | degrees (dp_replicate, dp_shard, tp, pp) | GB per device | predicted step |"
                      " tokens/s | MFU | why not first |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for i, c in enumerate(mp.ranked[:1 + NUM_ALTERNATIVES]):
            d, t = c.degrees, c.time
            timing = f"{t.total_s:.3g} s | {t.tokens_per_s:,.0f} | {t.mfu:.0%}" if t else "- | - | -"
            why = "recommended" if i == 0 else why_loses(c, best)
            lines.append(f"| {i + 1} | `{' '.join(c.overrides)}` | {d.dp_replicate}, {d.dp_shard}, {d.tp}, {d.pp} |"
                         f" {gb(c.estimate.bytes.total)} | {timing} | {why} |")
    return lines


def expanded(mp: MemoryPlan, nodes: int):
    """The job's scheme on `nodes`: degrees its scheme file ties to the node count follow;
    when the degrees were fixed by hand, the same layout is replicated (dp_replicate grows)."""
    ctx, v = mp.ctx, mp.chosen.variant
    scheme = chosen_at(ctx.chosen, ctx.conf_dirs, current_nodes=ctx.nodes, current_tpn=ctx.tasks_per_node,
                       nodes=nodes, tasks_per_node=v.tasks_per_node)
    try:
        return ctx.variant(mp.key, scheme, nodes, v.tasks_per_node)
    except UserError:
        fixed = {a: v.degrees.of(Axis(a)) for a in AXES if a != "dp_replicate"}
        return ctx.variant(mp.key, dict(scheme, dp_replicate=-1, **fixed), nodes, v.tasks_per_node)


def expand_section(mp: MemoryPlan) -> list[str]:
    ctx, v = mp.ctx, mp.chosen.variant
    lines = [
        "## Expanding",
        "",
        f"The same job (global batch {ctx.global_batch}) under {mp.key} on more nodes:",
        "",
        "| nodes | degrees | micro x accumulation | GB per device | fits | bottleneck |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for factor in (1, *FACTORS):
        nodes = v.nodes * factor
        try:
            w = v if factor == 1 else expanded(mp, nodes)
        except UserError as exc:
            lines.append(f"| {nodes} | cannot run: {exc} | | | | |")
            continue
        est = estimate(ctx, w)
        neck = bottleneck(traffic(ctx.shape, ctx.job(w), w.tasks_per_node))
        fits = {True: "yes", False: "NO", None: "-"}[est.fits]
        where = f"{neck.axis} ({'between nodes' if neck.crosses_nodes else 'inside a node'})" if neck else "-"
        lines.append(f"| {nodes} | {w.degrees.describe()} | {w.micro_batch} x {w.num_micro} | {gb(est.bytes.total)}"
                     f" | {fits} | {where} |")
    return lines


def fabric_section(plan: Plan) -> list[str]:
    """What each node will choose at start, and why, as far as the login node can say: the
    rule, the check, and the settings fixed by hand that win (dtk.topology.choose)."""
    cfg = plan.config
    backend = cfg.dist.backend.value
    if backend == "auto":  # as the worker decides: nccl on a GPU, gloo without
        backend = "gloo" if cfg.dist.device.value == "cpu" else "auto"
    nccl = backend in ("nccl", "auto")
    lines = [
        "## Fabric",
        "",
        "Chosen on each node at start, before the process group, from what the node shows"
        " (dtk.topology): the login node cannot see the compute nodes' ports. The choice is recorded"
        " in topology.json, the `topology` event and `python -m dtk.status`.",
        "",
    ]
    if not cfg.fabric.detect:
        lines.append("- discovery off (fabric.detect=false): NCCL, gloo and the environment choose for themselves.")
    elif plan.nodes == 1:
        lines.append("- one node: rendezvous and gloo on the loopback interface.")
    else:
        lines.append(f"- interface: the fastest one all {plan.nodes} nodes share, with addresses that tell them apart,"
                     " never loopback: GLOO_SOCKET_IFNAME" + (" and NCCL_SOCKET_IFNAME" if nccl else "")
                     + "; MASTER_ADDR is the first node's address on it.")
    if backend == "auto":
        lines.append("- backend: NCCL where the workers see a GPU, gloo (TCP on the interface above) where they do not"
                     " (dist.backend=auto).")
    if nccl and cfg.fabric.detect:
        lines.append("- NCCL: InfiniBand where every node has an active IB port (NCCL_IB_HCA = those ports), else RoCE"
                     " likewise, else TCP sockets (NCCL_IB_DISABLE=1).")
        lines.append(f"- check: fabric.require={cfg.fabric.require.value}: NCCL's own report of its transport is read"
                     " before training; `auto` stops a job whose nodes have IB or RoCE when NCCL chose sockets.")
    elif not nccl:
        lines.append("- backend gloo: TCP sockets; no transport check (it applies to NCCL).")
    fixed = [f"{k}={v}" for k, v in sorted(cfg.cluster.env.items()) if k in CHOSEN_KEYS]
    lines.append(f"- fixed by hand in cluster.env (wins over what is detected): {', '.join(fixed) or 'nothing'}.")
    if cfg.cluster.setup:
        lines.append(f"- setup files run first: {', '.join(cfg.cluster.setup)}; what they export wins as well.")
    return lines


def plan_markdown(plan: Plan, mp: MemoryPlan | None, note: str | None = None) -> str:
    lines = [
        f"# Topology scheme of {plan.run_name}",
        "",
        f"Config hash {plan.config_hash}; scheme {plan.scheme}: {plan.degrees.describe()}; global batch"
        f" {plan.global_batch} = micro {plan.micro_batch} x accumulation {plan.grad_accum} x data-parallel"
        f" {plan.degrees.dp}. Written by python -m dtk.submit; `python -m dtk.plan` with the run's overrides"
        " prints the same budget.",
        "",
        f"Synchronization of the data-parallel replicas: {describe_sync(plan.config.sync, plan.config.scheme or SchemeConfig())}.",
        "",
        *mesh_section(plan.degrees, plan.nodes, plan.tasks_per_node),
        "",
        *fabric_section(plan),
        "",
    ]
    if mp is None:
        lines += ["## Memory per device", "", f"Not planned: {note or 'the model could not be counted'}.", ""]
    else:
        for section in (memory_section, traffic_section, why_section, expand_section):
            lines += [*section(mp), ""]
    return "\n".join(lines)
