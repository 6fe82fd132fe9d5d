"""The memory plan of a job, as a table and as JSON (`python -m dtk.plan [--json]`)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from dtk.plan.cost.budget import (
    Context,
    Estimate,
    Recommendation,
    SchemeRow,
    all_rows,
    estimate,
    smallest_devices,
    smallest_fit,
)
from dtk.plan.cost.comm import AxisTraffic, bottleneck, traffic
from dtk.plan.cost.memory import FRAGMENTATION, RUNTIME_BYTES
from dtk.plan.cost.search import Candidate, searched, why_loses
from dtk.plan.cost.steptime import Hardware, StepTime, hardware_of, step_time
from dtk.plan.cost.variants import SCHEME_KEYS, Variant, chosen_at, scheme_key
from dtk.plan.plan import Plan
from dtk.plan.shape import ModelShape
from dtk.plan.sync import DATA_AXES, EXCHANGE_DOMINATES, EXCHANGE_TARGET, Option, WeakLink, weak_link

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
    hardware: Hardware | None = None
    predicted: StepTime | None = None
    """The job as given: its predicted step (None without a time model or when it does not fit)."""
    ranked: tuple[Candidate, ...] = ()
    """The searched candidates, best first (dtk.plan.cost.search)."""
    weak: WeakLink | None = None
    """The replicas' exchange of the job as given and the weak-link advice (dtk.plan.sync); None without a predicted step."""

    @property
    def fits(self) -> bool | None:
        return self.chosen.fits

    @property
    def checkpoint_bytes(self) -> int:
        """A checkpoint holds every parameter once with its optimizer state (params + moments);
        under +sync each replica's own (dtk.train.sync), beside the anchor and diloco's outer
        momentum."""
        p = self.ctx.job(self.chosen.variant).precision
        one = round(self.ctx.shape.params * (p.param_bytes + p.optimizer_bytes))
        if not self.ctx.sync.mode:
            return one
        kept = 2 if self.ctx.sync.outer_momentum > 0 else 1
        return self.chosen.variant.degrees.dp_replicate * one + round(kept * self.ctx.shape.params * p.param_bytes)

    @property
    def room(self) -> int | None:
        """Device bytes the job as given leaves free; None when the device's memory is unknown."""
        return None if self.ctx.capacity is None else self.ctx.capacity - self.chosen.bytes.total

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
            "recommended": self._recommended_json(),
            "alternatives": [c.to_json(why_loses(c, self.ranked[0])) for c in self.ranked[1:1 + NUM_ALTERNATIVES]],
            "predicted_step_s": None if self.predicted is None else round(self.predicted.total_s, 4),
            "predicted": None if self.predicted is None else self.predicted.to_json(),
            "time_model": None if self.hardware is None else self.hardware.source,
            "weak_link": None if self.weak is None else weak_link_json(self.weak),
            "activations_estimated": self.ctx.shape.has_activation_shape,
            "schemes": {k: _row_json(r) for k, r in self.rows.items()},
        }

    def _recommended_json(self) -> dict[str, Any]:
        out = asdict(self.recommended)
        if self.ranked:
            out.update(self.ranked[0].to_json(self.recommended.reason))
        else:
            out.update(degrees=None, predicted_step_s=None)
        return out

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
            f"model       {ctx.shape.params:,} parameters ({ctx.shape.source}){_active(ctx.shape)}",
            f"device      {ctx.device}, memory per device {cap}",
            f"memory      {gb(b.total)} GB per device under {self.key} on {v.nodes} node(s):"
            f" {_verdict(self.fits)}{_unestimated(ctx.shape)}",
            f"            margin: {FRAGMENTATION:.0%} of the rest for fragmentation + {gb(RUNTIME_BYTES[ctx.device])}"
            " GB runtime per process",
        ]
        if b.detail:
            lines.append("buffers     " + ", ".join(f"{k} {gb(n)} GB" for k, n in b.detail.items()))
        if b.host:
            lines.append(f"host        {gb(b.host)} GB per worker (staged checkpoint copy, offloaded states)")
        if self.min_nodes or ctx.capacity is None:
            lines.append(f"smallest    {self.min_devices or '-'} device(s), {self.min_nodes or '-'} node(s) that fit"
                         f" under {self.key}")
        else:
            lines.append(f"smallest    no node count up to {NODE_LIMIT} fits under {self.key}")
        if self.hardware is None:
            lines.append("step time   not predicted (a GPU of known peak: cluster.accelerator or cluster.peak_tflops)")
        elif self.predicted is not None:
            lines.append(f"step time   {self.predicted.describe()} under {self.key} as given"
                         f" [{self.hardware.source}]")
        elif self.fits is False:
            lines.append("step time   not predicted: the job as given does not fit")
        else:
            lines.append("step time   not predicted: no sequence length to count tokens by (plan.seq_len)")
        if self.weak is not None:
            lines += weak_link_lines(self.weak, self.ctx, self.room)
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
        if self.ranked:
            lines.append(f"            {_degrees(self.ranked[0])}: {self.ranked[0].describe().split(': ', 1)[1]}")
        for c in self.ranked[1:1 + NUM_ALTERNATIVES]:
            lines.append(f"instead     {' '.join(c.overrides)}: {why_loses(c, self.ranked[0])}; {_degrees(c)},"
                         f" {c.describe().split(': ', 1)[1]}")
        return "\n".join(lines) + "\n\n" + self.table()


NUM_ALTERNATIVES = 3
NODE_LIMIT = 4096


def _degrees(c: Candidate) -> str:
    d = c.degrees
    return f"dp_replicate={d.dp_replicate} dp_shard={d.dp_shard} tp={d.tp} pp={d.pp} micro {c.variant.micro_batch}"


def _unestimated(shape) -> str:
    """The memory line's word on activations that were not estimated, and what to give."""
    if shape.has_activation_shape:
        return ""
    if shape.exact:
        return "; activations not estimated (the model's depth, width and sequence length are unknown)"
    missing = [f"plan.{k}" for k in ("layers", "hidden", "seq_len") if not getattr(shape, k)]
    return f"; activations not estimated (0 counted): give {', '.join(missing)} (and plan.heads) to estimate them"


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


QUALITY = {
    "diloco": "quality: measured at sync.every=8 on the built-in model, DiLoCo's final loss was within 2% of"
              " every-step DDP's (local SGD's 1% above); a larger sync.every was not measured and drifts further"
              " from every-step training: hold its loss against a short every-step run",
    "bf16": "quality: bfloat16 gradients left the measured loss unchanged to 5 digits (AdamW absorbs the rounding)",
    "powersgd": "quality: PowerSGD at rank 2, compressing from the end of the learning-rate warm-up, ended 2% above"
                " every-step DDP's loss over 600 steps of the built-in model (70% above over 160 steps when it"
                " compressed from step 10, inside the warm-up): hold its loss against every-step DDP's",
}
"""The expected quality cost of each option, in words: docs/benchmarks.md's measured figures."""
MEASURED = ("docs/benchmarks.md, 'A weak link: the loss of exchanging less' (loss) and 'A weak link: step time on"
            " two throttled lab nodes' (speed)")


KEPT = {"diloco": "the anchor, outer momentum and the exchange's copies", "powersgd": "error feedback, P and Q"}
"""What an option adds to a rank's memory (dtk.plan.cost.exchange.exchange_state), in words."""


def _option_line(o: Option, as_given: StepTime, room: int | None) -> str:
    extra = f", +{gb(o.extra_bytes)} GB per device ({KEPT[o.kind]})" if o.extra_bytes > 0 else ""
    if room is not None and o.extra_bytes > room:
        extra += f", which does NOT fit ({gb(room)} GB to spare)"
    named = " (+scheme=ddp first, if the command names no scheme)" if o.kind != "diloco" else ""
    return (f"{' '.join(o.overrides)}{named}: exchange {o.share:.0%} of a {o.step.total_s:.3g} s step"
            f" (x{as_given.total_s / o.step.total_s:.3g} faster){extra}; {QUALITY[o.kind]}")


def weak_link_advice(w: WeakLink, room: int | None = None) -> list[str]:
    """The advice as sentences (plan.md's hints, the plan's lines): empty when none is given.
    `room`: device bytes the job as given leaves free (None: unknown)."""
    if not w.options and not w.refused:
        return []
    head = (f"the data-parallel exchange takes {w.share:.0%} of the predicted step (>= {EXCHANGE_DOMINATES:.0%}):"
            f" synchronize less often or compress; sync.every is the smallest that brings DiLoCo's exchange under"
            f" {EXCHANGE_TARGET:.0%} of the step; measured figures: {MEASURED}")
    lines = [head, *(_option_line(o, w.step, room) for o in w.options)]
    if w.refused:
        lines.append(f"+sync is not open to this scheme: {w.refused}")
    return lines


def weak_link_lines(w: WeakLink, ctx: Context, room: int | None) -> list[str]:
    """The `exchange` and `weak link` lines of python -m dtk.plan."""
    if not any(axis in w.step.axes for axis in DATA_AXES):
        return []  # no data-parallel exchange to speak of (one replica, no FSDP)
    share = f"exchange    data-parallel {w.share:.0%} of the predicted step ({w.exchange_s:.3g} s of {w.step.total_s:.3g} s)"
    if ctx.sync.every:
        return [f"{share} under +sync={ctx.sync.mode}, every {ctx.sync.every} steps"]
    advice = weak_link_advice(w, room)
    if not advice:
        return [f"{share}: under {EXCHANGE_DOMINATES:.0%}, no advice to exchange less"]
    return [f"{share}", *(f"weak link   {line}" for line in advice)]


def weak_link_json(w: WeakLink) -> dict[str, Any]:
    return {
        "exchange_share": round(w.share, 4), "exchange_s": round(w.exchange_s, 4),
        "dominates_from": EXCHANGE_DOMINATES, "target": EXCHANGE_TARGET, "refused": w.refused or None,
        "options": [{"kind": o.kind, "overrides": list(o.overrides), "predicted_step_s": round(o.step.total_s, 4),
                     "exchange_share": round(o.share, 4), "extra_bytes": o.extra_bytes, "every": o.every or None,
                     "quality": QUALITY[o.kind]} for o in w.options],
        "measured": MEASURED if w.options else None,
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
    hw = hardware_of(plan.config.cluster, device=ctx.device, param_dtype=str(ctx.chosen["param_dtype"]),
                     doctor=plan.config.plan.doctor)
    own = estimate(ctx, chosen)
    predicted = weak = None
    if hw is not None and own.fits is not False:
        predicted = step_time(ctx.shape, ctx.job(chosen), global_batch=ctx.global_batch,
                              tasks_per_node=ctx.tasks_per_node, hw=hw)
        weak = weak_link(ctx.shape, ctx.job(chosen), global_batch=ctx.global_batch,
                         tasks_per_node=ctx.tasks_per_node, hw=hw)
    ranked: list[Candidate] = []
    if ctx.capacity is None:
        rec = Recommendation("", f"device memory unknown ({ctx.capacity_source})", [], [])
    else:
        mem_gb = plan.config.cluster.mem_gb
        ranked, where = searched(ctx, hw, max_nodes=plan.config.plan.max_nodes,
                                 host_node_bytes=mem_gb * 2**30 if mem_gb else None)
        rec = _recommendation(ranked, where, hw)
        if ranked and not ctx.shape.has_activation_shape:
            rec = dataclasses.replace(rec, reason=rec.reason + "; activations not estimated: it fits the states alone")
    room = None if ctx.capacity is None else ctx.capacity - own.bytes.total
    if weak is not None and weak_link_advice(weak, room):
        rec = dataclasses.replace(rec, hints=[*rec.hints, *(f"the job as given: {h}" for h in weak_link_advice(weak, room))])
    return MemoryPlan(
        ctx=ctx, key=chosen.key, chosen=own, min_nodes=found.nodes if found else None,
        min_devices=smallest_devices(ctx, make_at), rows=rows, recommended=rec,
        traffic=traffic(ctx.shape, ctx.job(chosen), ctx.tasks_per_node), hardware=hw, predicted=predicted,
        ranked=tuple(ranked), weak=weak,
    )


def _recommendation(ranked: list[Candidate], where: str, hw: Hardware | None) -> Recommendation:
    if not ranked:
        return Recommendation("", where, [], [])
    best = ranked[0]
    if hw is None or best.time is None:
        unknown = "for this device" if hw is None else "without the sequence length (plan.seq_len)"
        why = f"{where}; the simplest layout that fits (no step-time model {unknown})"
    elif len(ranked) == 1:
        why = f"{where}; the only layout that fits"
    else:
        why = f"{where}; the shortest predicted step ({best.time.total_s:.3g} s) of {len(ranked)} layouts that fit"
    return Recommendation(best.key, why, list(best.overrides), [])


def _active(shape: ModelShape) -> str:
    """A mixture of experts' parameters one token computes with (what FLOPs count), when fewer."""
    active = round(shape.active_params)
    return f", {active:,} active per token" if active < shape.params else ""
