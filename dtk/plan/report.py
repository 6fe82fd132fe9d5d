"""The memory plan of a job, as a table and as JSON (`python -m dtk.plan [--json]`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dtk.plan.budget import (
    Context,
    Estimate,
    Recommendation,
    SchemeRow,
    all_rows,
    estimate,
    recommend,
    smallest_devices,
    smallest_fit,
)
from dtk.plan.comm import AxisTraffic, bottleneck, traffic
from dtk.plan.memory import FRAGMENTATION, RUNTIME_BYTES
from dtk.plan.plan import Plan
from dtk.plan.variants import SCHEME_KEYS, Variant, chosen_at, scheme_key

KINDS = ("params", "grads", "optimizer", "activations", "buffers", "margin", "total")


def gb(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


@dataclass(frozen=True)
class MemoryPlan:
    ctx: Context
    key: str
    chosen: Estimate
    min_nodes: int | None
    min_devices: int | None
    rows: dict[str, SchemeRow]
    recommended: Recommendation
    traffic: list[AxisTraffic]

    @property
    def fits(self) -> bool | None:
        return self.chosen.fits

    @property
    def checkpoint_bytes(self) -> int:
        """A checkpoint holds every parameter once with its optimizer state (params + moments)."""
        p = self.ctx.job(self.chosen.variant).precision
        return round(self.ctx.shape.params * (p.param_bytes + p.optimizer_bytes))

    def to_json(self) -> dict[str, Any]:
        b = self.chosen.bytes
        neck = bottleneck(self.traffic)
        return {
            "params": self.ctx.shape.params,
            "model": self.ctx.shape.source,
            "device": {"kind": self.ctx.device, "memory_bytes": self.ctx.capacity, "source": self.ctx.capacity_source},
            "nodes": self.chosen.variant.nodes,
            "tasks_per_node": self.chosen.variant.tasks_per_node,
            "scheme": self.key,
            "degrees": asdict(self.chosen.variant.degrees),
            "fits": self.fits,
            "per_device_bytes": b.as_dict(),
            "model_states_bytes": b.model_states,
            "activations_saved_bytes": b.activations_saved,
            "buffers_detail": b.detail,
            "host_bytes": b.host,
            "margin": {"fragmentation": FRAGMENTATION, "runtime_bytes": RUNTIME_BYTES[self.ctx.device]},
            "min_devices": self.min_devices,
            "min_nodes": self.min_nodes,
            "checkpoint_bytes": self.checkpoint_bytes,
            "comm": [asdict(a) | {"bottleneck": a is neck} for a in self.traffic],
            "recommended": asdict(self.recommended),
            "schemes": {k: _row_json(r) for k, r in self.rows.items()},
        }

    def table(self) -> str:
        """Per-device GB of the job's scheme and every scheme side by side, same node count."""
        cols: list[tuple[str, Estimate | None, str | None, int | None]] = [
            ("job: " + self.key, self.chosen, None, self.min_nodes)]
        cols += [(k, r.estimate, r.error, r.min_nodes) for k, r in self.rows.items()]
        width = max(9, *(len(c[0]) + 1 for c in cols))
        lines = [f"{'GB/device':<12}" + "".join(f"{c[0]:>{width}}" for c in cols)]
        for kind in KINDS:
            cells = [gb(c[1].bytes.as_dict()[kind]) if c[1] else "n/a" for c in cols]
            lines.append(f"{kind:<12}" + "".join(f"{x:>{width}}" for x in cells))
        fits = ["-" if c[1] is None or c[1].fits is None else ("yes" if c[1].fits else "NO") for c in cols]
        lines.append(f"{'fits':<12}" + "".join(f"{x:>{width}}" for x in fits))
        lines.append(f"{'min nodes':<12}" + "".join(f"{(c[3] or '-')!s:>{width}}" for c in cols))
        for c in cols:
            if c[2]:
                lines.append(f"  {c[0]}: n/a at this size: {c[2]}")
        return "\n".join(lines)

    def describe(self) -> str:
        b, v, ctx = self.chosen.bytes, self.chosen.variant, self.ctx
        cap = f"{gb(ctx.capacity)} GB ({ctx.capacity_source})" if ctx.capacity else ctx.capacity_source
        lines = [
            f"model       {ctx.shape.params:,} parameters ({ctx.shape.source})",
            f"device      {ctx.device}, memory per device {cap}",
            f"memory      {gb(b.total)} GB per device under {self.key} on {v.nodes} node(s):"
            f" {_verdict(self.fits)}",
            f"            margin: {FRAGMENTATION:.0%} of the rest for fragmentation + {gb(RUNTIME_BYTES[ctx.device])}"
            " GB runtime per process",
        ]
        if b.detail:
            lines.append("buffers     " + ", ".join(f"{k} {gb(n)} GB" for k, n in b.detail.items()))
        if b.host:
            lines.append(f"host        {gb(b.host)} GB per worker (staged checkpoint copy, offloaded states)")
        lines.append(f"smallest    {self.min_devices or '-'} device(s), {self.min_nodes or '-'} node(s) that fit under {self.key}")
        lines.append(f"checkpoint  {gb(self.checkpoint_bytes)} GB")
        neck = bottleneck(self.traffic)
        for a in self.traffic:
            where = "crosses nodes" if a.crosses_nodes else "inside a node"
            mark = "  <- bottleneck" if a is neck else ""
            lines.append(f"traffic     {a.axis}={a.size}: {gb(a.bytes_per_step)} GB/step per rank, {where} ({a.what}){mark}")
        r = self.recommended
        if r.scheme:
            lines.append(f"recommended {' '.join(r.overrides)}: {r.reason}")
        else:
            lines.append(f"recommended -: {r.reason}")
        lines += [f"            {h}" for h in r.hints]
        return "\n".join(lines) + "\n\n" + self.table()


def _verdict(fits: bool | None) -> str:
    return {True: "fits", False: "DOES NOT FIT", None: "not judged (device memory unknown)"}[fits]


def _row_json(r: SchemeRow) -> dict[str, Any]:
    if r.estimate is None:
        return {"error": r.error, "fits": None, "min_nodes": r.min_nodes, "min_devices": r.min_devices}
    b = r.estimate.bytes
    return {
        "fits": r.estimate.fits,
        "degrees": asdict(r.estimate.variant.degrees),
        "per_device_bytes": b.as_dict(),
        "model_states_bytes": b.model_states,
        "buffers_detail": b.detail,
        "host_bytes": b.host,
        "min_nodes": r.min_nodes,
        "min_devices": r.min_devices,
        "overrides": r.estimate.variant.overrides,
    }


def chosen_variant(ctx: Context, plan: Plan) -> Variant:
    return Variant(scheme_key(ctx.chosen), ctx.chosen, plan.degrees, plan.nodes, plan.tasks_per_node,
                   plan.micro_batch, plan.grad_accum)


def memory_plan(ctx: Context, plan: Plan) -> MemoryPlan:
    chosen = chosen_variant(ctx, plan)

    def make_at(nodes: int, tpn: int) -> Variant:
        scheme = chosen_at(ctx.chosen, ctx.conf_dirs, current_nodes=ctx.nodes, current_tpn=ctx.tasks_per_node,
                           nodes=nodes, tasks_per_node=tpn)
        return ctx.variant(chosen.key, scheme, nodes, tpn)

    found = smallest_fit(ctx, lambda n: make_at(n, ctx.tasks_per_node))
    rows = all_rows(ctx)
    assert set(rows) == set(SCHEME_KEYS)
    return MemoryPlan(
        ctx=ctx, key=chosen.key, chosen=estimate(ctx, chosen), min_nodes=found.nodes if found else None,
        min_devices=smallest_devices(ctx, make_at), rows=rows, recommended=recommend(ctx, rows),
        traffic=traffic(ctx.shape, ctx.job(chosen), ctx.tasks_per_node),
    )
