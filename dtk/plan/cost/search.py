"""The searched recommendation: every layout a job could run under, checked as a typed
command is, its memory estimated and its step time predicted, ranked.

Searched: the data-parallel layout (ddp, zero, zero2, fsdp, hsdp, replicas of a model
split by tp / pp), the tensor-parallel degree (divisors of the workers per node: tp stays
inside a node), the pipeline degree and its virtual stages (1F1B, interleaved 1F1B),
context parallelism for a long sequence and expert parallelism for a mixture of experts
(dtk.plan.cost.splits: FSDP layouts, inside a node with tp), activation
checkpointing, FSDP CPU offload, the micro-batch (powers of two that divide the
data-parallel rank's batch), and the node count: the job's own, and when nothing fits
there, the fewest above it (NODE_CANDIDATES, up to plan.max_nodes) at which something does.
Every candidate is built from its scheme file plus the overrides it prints, and goes
through the checks a typed command goes through (degrees, batch split, check_scheme, the
what-if's dimensions); one that fails is not a candidate.

Rank, in order: fits (its margin included) -> fewest nodes beyond the job's own (none,
when it fits there) -> shortest predicted step -> simplest (fewer overrides, then the
scheme's place in SIMPLE). Steps within TIE of the fastest count as equally fast: the
model is not finer than that. Without a step-time model (the CPU, a GPU of unknown peak) the rank
is fits -> nodes -> simplest.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from dtk.common.errors import UserError
from dtk.config.choices import ActivationCheckpoint, DataParallel, PipelineSchedule
from dtk.plan.cost.budget import NODE_CANDIDATES, Context, Estimate, estimate
from dtk.plan.cost.splits import DEGREE_AXES, degrees_of, split_layouts, splits
from dtk.plan.cost.steptime import Hardware, StepTime, step_time
from dtk.plan.cost.variants import FAST_KEYS, Variant, checked_scheme, standard_scheme
from dtk.plan.degrees import Axis, Degrees, micro_batch_size, resolve_degrees
from dtk.plan.shape import is_builtin

SIMPLE = ("ddp", "zero", "zero2", "fsdp", "hsdp", "tp", "pp", "zero_tp_pp", "hybrid")
"""Scheme files from the simplest to the most involved (the tie-break)."""
TIE = 0.03
OPTIONS = FAST_KEYS
"""Scheme keys besides the degrees (one per Axis) that the search sets; the overrides name
those that differ from the scheme file."""
MAX_PP = 16
"""Deepest pipeline searched (the published runs of docs/planning.md go to 8; each stage is
a rank whose memory the budget computes)."""
HOST_NODE_BYTES = 2 * 10**12
"""Host memory of a node when cluster.mem_gb does not say (a DGX H100 or A100 has 2 TB): what
CPU offload and the staged checkpoint copy may take, shared by the node's workers."""
KNOBS = ({"activation_checkpoint": ActivationCheckpoint.none}, {"activation_checkpoint": ActivationCheckpoint.selective},
         {"activation_checkpoint": ActivationCheckpoint.full},
         {"activation_checkpoint": ActivationCheckpoint.full, "cpu_offload": True})
"""From the cheapest in time to the cheapest in memory: a layout takes the first that fits."""


@dataclass(frozen=True)
class Candidate:
    key: str
    """The scheme file typed (`+scheme=KEY`)."""
    overrides: list[str]
    estimate: Estimate
    time: StepTime | None

    host_capacity: int | None = None
    """Host bytes one worker may use (None: not checked)."""

    @property
    def variant(self) -> Variant:
        return self.estimate.variant

    @property
    def fits(self) -> bool:
        host_ok = self.host_capacity is None or self.estimate.bytes.host <= self.host_capacity
        return bool(self.estimate.fits) and host_ok

    @property
    def degrees(self) -> Degrees:
        return self.variant.degrees

    @property
    def complexity(self) -> tuple[int, int]:
        return len(self.overrides), SIMPLE.index(self.key)

    @property
    def step_s(self) -> float | None:
        return None if self.time is None else self.time.total_s

    def describe(self) -> str:
        b = self.estimate.bytes
        spare = "" if self.estimate.capacity is None else f" ({(self.estimate.capacity - b.total) / 1e9:.1f} GB to spare)"
        text = f"{' '.join(self.overrides)}: {b.total / 1e9:.1f} GB per device{spare}"
        return text + (f", {self.time.describe()}" if self.time else "")

    def to_json(self, reason: str) -> dict[str, Any]:
        return {"scheme": self.key, "overrides": list(self.overrides), "degrees": dataclasses.asdict(self.degrees),
                "nodes": self.variant.nodes, "micro_batch": self.variant.micro_batch,
                "per_device_bytes": self.estimate.bytes.total,
                "predicted_step_s": None if self.time is None else round(self.time.total_s, 4),
                "time": None if self.time is None else self.time.to_json(), "reason": reason}


def _divisors(n: int, limit: int) -> list[int]:
    return [k for k in range(1, min(n, limit) + 1) if n % k == 0]


def _keys(d: Degrees, **options: Any) -> dict[str, Any]:
    """The scheme keys of a layout: its degree on each Axis, and its options (typed values)."""
    return {**{axis.value: d.of(axis) for axis in DEGREE_AXES}, **options}


def _layouts(nodes: int, tpn: int, world: int, blocks: int, *, max_tp: int,
             sequence_parallel: bool) -> list[tuple[str, dict[str, Any]]]:
    """(scheme file, degree and layout keys) of every structure at a size."""
    out: list[tuple[str, dict[str, Any]]] = []
    ddp, fsdp = DataParallel.ddp, DataParallel.fsdp
    for tp in (t for t in _divisors(tpn, max_tp) if t & (t - 1) == 0):
        for pp in _divisors(world // tp, min(blocks, MAX_PP)):
            dp = world // (tp * pp)

            def grid(replicate: int, shard: int, pp: int = pp, tp: int = tp) -> Degrees:
                return Degrees(dp_replicate=replicate, pp=pp, dp_shard=shard, tp=tp)

            # Sequence parallelism costs no more traffic than tp's all-reduces and keeps norms
            # and residuals split: always with tp.
            sp = sequence_parallel and tp > 1
            if tp == 1 and pp == 1:
                out.append(("ddp", _keys(grid(dp, 1), sequence_parallel=sp, data_parallel=ddp)))
                if dp > 1:
                    out.append(("zero", _keys(grid(dp, 1), sequence_parallel=sp, data_parallel=ddp,
                                              shard_optimizer=True)))
                    out.append(("zero2", _keys(grid(1, dp), sequence_parallel=sp, data_parallel=fsdp,
                                               reshard_after_forward=False)))
            if tp * pp > 1 and dp > 1:
                # ZeRO-1 with tp / pp, without sequence parallelism: the layout its runtime is tested in
                out.append(("zero_tp_pp", _keys(grid(dp, 1), sequence_parallel=False, data_parallel=ddp,
                                                shard_optimizer=True)))
            out.append(("fsdp" if tp == pp == 1 else "hybrid", _keys(grid(1, dp), sequence_parallel=sp,
                                                                     data_parallel=fsdp)))
            inside = max(1, tpn // (tp * pp)) if tpn % (tp * pp) == 0 else 1  # data-parallel ranks on one node
            for shard in sorted({inside, 1}):
                if 1 < dp // shard and dp % shard == 0 and shard < dp:
                    out.append(("hybrid", _keys(grid(dp // shard, shard), sequence_parallel=sp, data_parallel=fsdp)))
    return out


def _file_key(key: str, keys: dict[str, Any], nodes: int, tpn: int, world: int) -> str:
    """The named scheme file whose defaults are this structure, else hybrid."""
    d = degrees_of(keys)
    if key == "hybrid":
        if d == Degrees(dp_replicate=nodes, pp=1, dp_shard=world // nodes, tp=1) and nodes > 1:
            return "hsdp"
        if d == Degrees(dp_replicate=1, pp=1, dp_shard=nodes, tp=tpn) and tpn > 1:
            return "tp"
        if d == Degrees(dp_replicate=1, pp=world, dp_shard=1, tp=1):
            return "pp"
    return key


class Search:
    """One search over a budget context; `at(nodes)` gives the fitting candidates at a size."""

    def __init__(self, ctx: Context, hw: Hardware | None, *, host_node_bytes: int | None = None) -> None:
        self.ctx, self.hw = ctx, hw
        self.host_capacity = (host_node_bytes or HOST_NODE_BYTES) // ctx.tasks_per_node if ctx.device == "cuda" else None
        self.blocks = sum(1 for _, is_block in ctx.shape.units if is_block)
        # A model whose tensors tensor parallelism does not split (a user's without tp_plan)
        # gains nothing from tp; sequence parallelism needs the built-in's plan (or a what-if).
        self.max_tp = ctx.tasks_per_node if any(t.tp_dim is not None for t in ctx.shape.tensors) else 1
        self.sequence_parallel = not ctx.shape.exact or is_builtin(ctx.model_checks)
        self.base_cache: dict[tuple[str, int], dict[str, Any]] = {}
        self.splits = splits(ctx.shape, ctx.tasks_per_node)
        self.bound: Counter[str] = Counter()
        """Structures that no candidate of fits, by the constraint that excluded them."""
        self.refused: str | None = None

    def base(self, key: str, nodes: int) -> dict[str, Any]:
        if (key, nodes) not in self.base_cache:
            ctx = self.ctx
            self.base_cache[key, nodes] = standard_scheme(key, ctx.conf_dirs, ctx.defaults, ctx.chosen,
                                                          nodes=nodes, tasks_per_node=ctx.tasks_per_node)
        return self.base_cache[key, nodes]

    def bare(self, key: str, nodes: int) -> dict[str, Any]:
        """The scheme file alone, without the job's own choices: what the overrides typed on a
        command without them give; a key is printed when it differs from this or from `base`."""
        if (key, -nodes) not in self.base_cache:
            ctx = self.ctx
            self.base_cache[key, -nodes] = standard_scheme(key, ctx.conf_dirs, ctx.defaults, {},
                                                           nodes=nodes, tasks_per_node=ctx.tasks_per_node)
        return self.base_cache[key, -nodes]

    def candidate(self, key: str, keys: dict[str, Any], nodes: int, micro: int) -> Candidate | None:
        """The candidate as its overrides would type it, or None when a check refuses it."""
        ctx, tpn = self.ctx, self.ctx.tasks_per_node
        base = self.base(key, nodes)
        scheme = dict(base, **keys)
        overrides = [f"+scheme={key}"]
        try:  # the file's own degrees may not divide this size (zero_tp_pp's tp=2 x pp=2): all printed
            base_degrees: Degrees | None = resolve_degrees(checked_scheme(base), nodes * tpn)
        except UserError:
            base_degrees = None
        if base_degrees != degrees_of(scheme):
            overrides += [f"scheme.{a}={scheme[a.value]}" for a in DEGREE_AXES if isinstance(a, Axis) or scheme[a.value] != 1]
        for k in OPTIONS:
            if scheme[k] != base[k] or scheme[k] != self.bare(key, nodes)[k]:
                overrides.append(f"scheme.{k}={str(scheme[k]).lower()}")
        try:
            v = ctx.variant(key, scheme, nodes, tpn, micro_batch=micro)
        except UserError as exc:
            self.refused = _constraint(str(exc))
            return None
        # train.micro_batch is printed unless both the job's and a bare command's give this one
        if any(self._derived(scheme, v.degrees, given) != micro for given in {ctx.micro_batch, None}):
            overrides.append(f"train.micro_batch={micro}")
        overrides.append(f"nodes={nodes}")
        return Candidate(key, overrides, estimate(ctx, v), None, self.host_capacity)

    def _derived(self, scheme: dict[str, Any], degrees: Degrees, given: int | None) -> int | None:
        try:
            return micro_batch_size(checked_scheme(scheme), micro_batch=given, global_batch=self.ctx.global_batch,
                                    degrees=degrees)
        except UserError:
            return None

    def _micros(self, dp: int) -> list[int]:
        if self.ctx.global_batch % dp:
            return []
        local = self.ctx.global_batch // dp
        return [m for m in (2**k for k in range(12)) if m <= local and local % m == 0]

    def timed(self, c: Candidate) -> Candidate:
        if self.hw is None:
            return c
        t = step_time(self.ctx.shape, self.ctx.job(c.variant), global_batch=self.ctx.global_batch,
                      tasks_per_node=self.ctx.tasks_per_node, hw=self.hw)
        return dataclasses.replace(c, time=t)

    def best_of(self, key: str, keys: dict[str, Any], nodes: int) -> Candidate | None:
        """A structure with the first knobs under which it fits, at its fastest micro-batch.
        In the time model a pipeline runs fastest and smallest with one sample per micro-batch
        (the most micro-batches, the least bubble), so it takes the smallest micro-batch that
        its schedule accepts; any other layout the largest that fits (fewest gathers per step),
        found by bisection: memory grows with the micro-batch."""
        degrees = degrees_of(keys)
        micros = self._micros(degrees.dp)
        self.refused, tried = BATCH if not micros else None, False
        for knob in KNOBS:
            if knob.get("cpu_offload") and (keys["data_parallel"] != DataParallel.fsdp or self.ctx.device != "cuda"):
                continue
            layout = dict(keys, **knob)
            if degrees.pp > 1:
                c = next((c for c in (self.candidate(key, layout, nodes, m) for m in micros) if c is not None), None)
                tried = tried or c is not None
                if c is not None and c.fits:
                    return self.timed(c)
                continue
            lo, hi, best = 0, len(micros) - 1, None
            while lo <= hi:
                mid = (lo + hi) // 2
                c = self.candidate(key, layout, nodes, micros[mid])
                tried = tried or c is not None
                if c is not None and c.fits:
                    best, lo = c, mid + 1
                else:
                    hi = mid - 1
            if best is not None:
                return self.timed(best)
        self.bound[MEMORY if tried else (self.refused or CHECKS)] += 1
        return None

    def at(self, nodes: int) -> list[Candidate]:
        tpn = self.ctx.tasks_per_node
        found = []
        self.bound.clear()
        world, sp = nodes * tpn, self.sequence_parallel
        layouts = _layouts(nodes, tpn, world, self.blocks, max_tp=self.max_tp, sequence_parallel=sp)
        layouts += split_layouts(tpn, world, self.max_tp, self.splits, max_pp=min(self.blocks, MAX_PP))
        for key, keys in layouts:
            pp = degrees_of(keys).pp
            for virtual in (1, 2) if pp > 1 and key != "zero_tp_pp" else (1,):  # ZeRO-1's runtime: 1F1B
                if virtual == 2 and 2 * pp > self.blocks:
                    continue
                layout = dict(keys, pp_virtual_stages=virtual,
                              pp_schedule=PipelineSchedule("interleaved_1f1b" if virtual > 1 else "1f1b"))
                if pp == 1:
                    layout.pop("pp_schedule")
                c = self.best_of(_file_key(key, keys, nodes, tpn, world), layout, nodes)
                if c is not None:
                    found.append(c)
        return found

    def frugal_fits(self, nodes: int) -> bool:
        """Whether the layouts that need the least memory (everything sharded or split,
        full checkpointing, offload, one sample per micro-batch) fit at a size: the cheap
        test of the search for the fewest nodes."""
        tpn, world = self.ctx.tasks_per_node, nodes * self.ctx.tasks_per_node
        for tp in sorted({1, min(tpn, self.max_tp)}):
            for pp in sorted({1, max(_divisors(world // tp, min(self.blocks, MAX_PP)))}):
                keys = _keys(Degrees(dp_replicate=1, pp=pp, dp_shard=world // (tp * pp), tp=tp),
                             activation_checkpoint=ActivationCheckpoint.full, cpu_offload=self.ctx.device == "cuda",
                             sequence_parallel=self.sequence_parallel and tp > 1, data_parallel=DataParallel.fsdp)
                c = self.candidate("hybrid", keys, nodes, 1)
                if c is not None and c.fits:
                    return True
        return False


BATCH = "the batch split (train.global_batch over the data-parallel size and micro-batch)"
SHAPE = "the model's shape (what tp and pp split)"
CHECKS = "the scheme's checks"
MEMORY = "device memory"


def _constraint(message: str) -> str:
    """Which constraint a refusal of check_scheme / make_variant names."""
    if message.startswith("train.global_batch=") or "pp_microbatches" in message:
        return BATCH
    if "does not divide" in message or "block(s) to split" in message or message.startswith("scheme.pp="):
        return SHAPE
    return CHECKS


def bound_by(bound: Counter[str]) -> str:
    """`; excluded: 12 by device memory, 3 by the batch split ...`: the constraints that bound
    the search at its size, most layouts first."""
    if not bound:
        return ""
    return "; excluded: " + ", ".join(f"{n} by {what}" for what, n in bound.most_common())


def _speed(c: Candidate) -> tuple[float, tuple[int, int]]:
    return (c.step_s if c.step_s is not None else 0.0), c.complexity


def rank(found: list[Candidate]) -> list[Candidate]:
    """Shortest step first, the simplest of those within TIE of the fastest at the top."""
    ordered = sorted(found, key=_speed)
    if not ordered or ordered[0].step_s is None:
        return sorted(found, key=lambda c: c.complexity)
    fastest = ordered[0].step_s
    tied = sorted((c for c in ordered if c.step_s is not None and c.step_s <= fastest * (1 + TIE)),
                  key=lambda c: c.complexity)
    return tied[:1] + [c for c in ordered if c is not tied[0]]


def searched(ctx: Context, hw: Hardware | None, *, max_nodes: int | None,
             host_node_bytes: int | None = None) -> tuple[list[Candidate], str]:
    """The ranked candidates at the size the search settles on, and why that size.
    `host_node_bytes`: a node's host memory (cluster.mem_gb), else HOST_NODE_BYTES."""
    s = Search(ctx, hw, host_node_bytes=host_node_bytes)
    found = s.at(ctx.nodes)
    asked = bound_by(s.bound)
    if found:
        return rank(found), f"fits on the {ctx.nodes} node(s) asked" + asked
    if ctx.local:
        return [], "nothing fits on this machine (the local cluster is one node)" + asked
    limit = max_nodes or NODE_CANDIDATES[-1]
    for n in (c for c in NODE_CANDIDATES if ctx.nodes < c <= limit):
        if s.frugal_fits(n):
            found = s.at(n)
            if found:
                return rank(found), (f"nothing fits on the {ctx.nodes} node(s) asked{asked.replace('; ', ' (', 1)}"
                                     f"{')' if asked else ''}; {n} is the fewest that fit")
    return [], f"nothing fits on any node count up to {limit}" + (asked.replace("excluded", "on the nodes asked, excluded"))


def stand_ins(world: int, tasks_per_node: int, global_batch: int) -> list[list[str]]:
    """Layouts whose data-parallel size divides the batch, the widest first: overrides that
    let the planner build a job to search from when the job names no layout and the
    default's data-parallel size (the world) does not split its batch. The rest of the world
    goes to tp (a power of two inside a node), then pp."""
    out = []
    for dp in (d for d in range(world, 0, -1) if world % d == 0 and global_batch % d == 0):
        rest = world // dp
        tp = max(t for t in _divisors(tasks_per_node, tasks_per_node) if rest % t == 0 and t & (t - 1) == 0)
        degrees = Degrees(dp_replicate=1, pp=rest // tp, dp_shard=dp, tp=tp)
        out.append(["+scheme=hybrid", *(f"scheme.{axis}={degrees.of(axis)}" for axis in Axis)])
    return out


def names_a_layout(overrides: list[str]) -> bool:
    """Whether a command chose its layout: a scheme file or a degree."""
    degree_keys = {f"scheme.{axis}" for axis in DEGREE_AXES}
    return any(o.lstrip("+").startswith("scheme=") or o.split("=", 1)[0] in degree_keys for o in overrides)


def why_loses(c: Candidate, best: Candidate) -> str:
    """Why `c` ranks below `best`, in a few words."""
    if c.variant.nodes != best.variant.nodes:
        return f"needs {c.variant.nodes} nodes"
    parts = []
    if c.step_s is not None and best.step_s is not None and c.step_s > best.step_s * 1.001:
        slower = c.step_s / best.step_s - 1
        parts.append(f"{slower:+.1%} step time" + (" (within the model's precision)" if slower <= TIE else ""))
    if c.complexity > best.complexity:
        parts.append("not as simple")
    if c.step_s is None:
        parts.append("no step time to compare")
    return ", ".join(parts) or "no better in the model"
