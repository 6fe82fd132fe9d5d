"""The memory budget of a job: every scheme at the job's size, the smallest size that fits,
and the scheme to recommend. Reads the composed config once (`Context.from_config`); the
rest is arithmetic on dtk.plan.memory.

Recommendation, in this order (the cheapest change that fits first):

1. data parallel (ddp), if the whole model with its gradients and optimizer state fits;
2. shard the optimizer state (zero), then the gradients (zero2), then the parameters
   (fsdp; hsdp on several nodes, so that the chatty traffic stays inside a node);
3. tensor parallel when one layer is what does not fit, pipeline when the depth is;
4. before adding nodes: activation checkpointing, lower precision or CPU offload, when one
   of them makes a scheme fit on the nodes asked for;
5. otherwise the scheme that fits on the fewest nodes, with that node count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtk.config.schema import ModelConfig
from dtk.errors import UserError
from dtk.plan.degrees import resolve_degrees
from dtk.plan.memory import Job, RankBytes, device_bytes, precision_for
from dtk.plan.shape import ModelShape
from dtk.plan.variants import SCHEME_KEYS, Variant, checked_scheme, make_variant, standard_scheme
from dtk.plan.whatif import check_whatif

# Node counts tried when looking for the smallest that fits: every count up to 64, then
# steps of an eighth of a power of two up to 4096.
NODE_CANDIDATES = tuple(range(1, 65)) + tuple(
    sorted({p + k * p // 8 for p in (64, 128, 256, 512, 1024, 2048) for k in range(1, 9)})
)
# Order in which schemes are recommended (hsdp before fsdp on several nodes).
ORDER = ("ddp", "zero", "zero2", "hsdp", "fsdp", "tp", "pp", "hybrid")


@dataclass(frozen=True)
class Context:
    """Everything the budget reads from the config, read once."""

    shape: ModelShape
    conf_dirs: tuple[str, ...]
    """Config folders, searched in order for scheme files (the user's, then dtk's)."""
    defaults: dict[str, Any]
    """The schema's scheme defaults."""
    chosen: dict[str, Any]
    """The job's composed scheme."""
    nodes: int
    tasks_per_node: int
    local: bool
    """The local cluster: one node, always."""
    global_batch: int
    micro_batch: int | None
    device: str
    capacity: int | None
    """Memory per device in bytes; None when unknown (then nothing is judged)."""
    capacity_source: str
    plan_keys: dict[str, Any]
    async_checkpoint: bool
    model_checks: ModelConfig
    """The model check_scheme reads (the built-in transformer's numbers; a model without them otherwise)."""
    split_points: tuple[str, ...] = ()

    def job(self, v: Variant, **changes: Any) -> Job:
        scheme = dict(v.scheme, **changes)
        return Job(
            scheme=scheme, degrees=v.degrees, micro_batch=v.micro_batch, num_micro=v.num_micro, device=self.device,
            precision=precision_for(scheme, self.device, self.plan_keys), async_checkpoint=self.async_checkpoint,
            split_points=self.split_points,
        )

    def variant(self, key: str, scheme: dict[str, Any], nodes: int, tasks_per_node: int | None = None, *,
                micro_batch: int | None = None) -> Variant:
        """`scheme` at a size, checked as a typed command is; `micro_batch` replaces the job's."""
        if not self.shape.exact:  # a what-if: its own dimensions, as make_plan checks a typed command
            check_whatif(resolve_degrees(checked_scheme(scheme), nodes * (tasks_per_node or self.tasks_per_node)),
                         self.shape, virtual_stages=int(scheme["pp_virtual_stages"]))
        v = make_variant(
            key, scheme, nodes=nodes, tasks_per_node=tasks_per_node or self.tasks_per_node,
            global_batch=self.global_batch, micro_batch=micro_batch or self.micro_batch, model=self.model_checks,
            blocks=sum(1 for _, is_block in self.shape.units if is_block),
        )
        stages = v.degrees.pp * int(v.scheme["pp_virtual_stages"]) if v.degrees.pp > 1 else 1
        if self.split_points and stages > 1 and len(self.split_points) + 1 != stages:
            # A model's own split points fix its number of stages (checked here for any model,
            # not only the built-in transformer that check_scheme reads).
            raise UserError(f"model.split_points make {len(self.split_points) + 1} pipeline stages, not {stages}")
        return v

    def standard(self, key: str, nodes: int, tasks_per_node: int | None = None) -> Variant:
        tpn = tasks_per_node or self.tasks_per_node
        scheme = standard_scheme(key, self.conf_dirs, self.defaults, self.chosen, nodes=nodes, tasks_per_node=tpn)
        return self.variant(key, scheme, nodes, tpn)


@dataclass(frozen=True)
class Estimate:
    variant: Variant
    bytes: RankBytes
    capacity: int | None

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.bytes.total <= self.capacity


def estimate(ctx: Context, v: Variant, **changes: Any) -> Estimate:
    return Estimate(v, device_bytes(ctx.shape, ctx.job(v, **changes)), ctx.capacity)


def smallest_fit(ctx: Context, make, **changes: Any) -> Variant | None:
    """The smallest node count (NODE_CANDIDATES) at which `make(nodes)` runs and fits.
    Memory per device does not grow with nodes, so a binary search over the counts where
    the scheme can run finds it."""
    if ctx.capacity is None:
        return None
    candidates = (1,) if ctx.local else NODE_CANDIDATES
    valid = []
    for n in candidates:
        try:
            valid.append(make(n))
        except UserError:
            continue
    lo, hi, found = 0, len(valid) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if estimate(ctx, valid[mid], **changes).fits:
            found, hi = valid[mid], mid - 1
        else:
            lo = mid + 1
    return found


def smallest_devices(ctx: Context, make_at) -> int | None:
    """Fewest devices that fit: part of one node first, then whole nodes."""
    if ctx.capacity is None:
        return None
    for tpn in range(1, ctx.tasks_per_node):
        try:
            if estimate(ctx, make_at(1, tpn)).fits:
                return tpn
        except UserError:
            continue
    found = smallest_fit(ctx, lambda n: make_at(n, ctx.tasks_per_node))
    return found.nodes * found.tasks_per_node if found else None


@dataclass(frozen=True)
class SchemeRow:
    key: str
    estimate: Estimate | None
    error: str | None
    min_nodes: int | None
    min_devices: int | None


def scheme_row(ctx: Context, key: str) -> SchemeRow:
    """One standard scheme at the job's size, and the smallest size at which it fits."""
    def make_at(n: int, tpn: int) -> Variant:
        return ctx.standard(key, n, tpn)

    try:
        est = estimate(ctx, ctx.standard(key, ctx.nodes))
        error = None
    except UserError as exc:
        est, error = None, str(exc)
    found = smallest_fit(ctx, lambda n: make_at(n, ctx.tasks_per_node))
    return SchemeRow(key, est, error, found.nodes if found else None, smallest_devices(ctx, make_at))


KNOBS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("scheme.activation_checkpoint=selective", {"activation_checkpoint": "selective"},
     "selective activation checkpointing (recompute norms and activations, keep matmul outputs)"),
    ("scheme.activation_checkpoint=full", {"activation_checkpoint": "full"},
     "full activation checkpointing (keep only each block's input)"),
    ("scheme.param_dtype=bfloat16", {"param_dtype": "bfloat16"}, "bf16 compute (activations and gathered weights in 2 bytes)"),
    ("scheme.cpu_offload=true", {"cpu_offload": True}, "FSDP CPU offload (states in host memory)"),
)


def _knob_applies(v: Variant, changes: dict[str, Any], device: str) -> bool:
    for key, value in changes.items():
        if v.scheme.get(key) == value:
            return False
        if key == "cpu_offload" and (v.scheme["data_parallel"] != "fsdp" or device != "cuda"):
            return False
        fp32_compute = v.scheme["param_dtype"] == "float32" or (v.scheme["param_dtype"] == "auto" and device == "cpu")
        if key == "param_dtype" and not fp32_compute:
            return False
        if key == "activation_checkpoint" and v.scheme["activation_checkpoint"] == "full":
            return False
    return True


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f} GB"


# Why each scheme, given that the ones before it in ORDER do not fit.
WHY = {
    "ddp": "the whole model, its gradients and optimizer state fit on every device: data parallel is the simplest and fastest",
    "zero": "sharding the optimizer state over the data-parallel ranks (ZeRO-1) is enough",
    "zero2": "with the gradients sharded too (ZeRO-2) it fits",
    "hsdp": "with the parameters sharded too; HSDP shards inside a node and replicates across nodes, so FSDP's"
            " all-gathers stay on the node's links",
    "fsdp": "with the parameters sharded too (FSDP, ZeRO-3) it fits",
    "tp": "even fully sharded, a layer's gathered weights and activations do not fit; tensor parallelism splits"
          " each layer (and its activations) inside a node",
    "pp": "even fully sharded, the activations of the whole depth do not fit; pipeline stages split the layers",
    "hybrid": "it takes tensor parallelism inside a node with FSDP across the ranks",
}


def reason(key: str, rows: dict[str, SchemeRow], capacity: int, order: list[str]) -> str:
    """Why `key`, with the numbers of the cheaper schemes that do not fit."""
    before = [k for k in order[: order.index(key)] if rows[k].estimate is not None]
    misses = ", ".join(f"{k} {_gb(rows[k].estimate.bytes.total)}" for k in before)
    fits = rows[key].estimate
    text = WHY[key]
    if misses:
        text = f"{misses} per device > {_gb(capacity)}; " + text
    if fits is not None:
        text += f" ({_gb(fits.bytes.total)} per device)"
    return text


@dataclass(frozen=True)
class Recommendation:
    scheme: str
    reason: str
    overrides: list[str]
    hints: list[str]


def _knob_hints(ctx: Context, keys: list[str], nodes: int) -> list[str]:
    """Activation checkpointing, lower precision or CPU offload that fit on fewer than `nodes`."""
    hints = []
    for key in keys:
        try:
            base = ctx.standard(key, nodes)
        except UserError:
            continue
        for override, changes, what in KNOBS:
            if not _knob_applies(base, changes, ctx.device):
                continue
            found = smallest_fit(ctx, lambda n, k=key: ctx.standard(k, n), **changes)
            if found and found.nodes < nodes:
                hints.append(f"{' '.join(found.overrides)} nodes={found.nodes} {override}: fits with {what}")
    return hints


def recommend(ctx: Context, rows: dict[str, SchemeRow]) -> Recommendation:
    order = [k for k in ORDER if not (k == "hsdp" and ctx.nodes == 1)]
    if ctx.capacity is None:
        return Recommendation("", f"device memory unknown ({ctx.capacity_source})", [], [])
    fitting = [k for k in order if rows[k].estimate is not None and rows[k].estimate.fits]
    if fitting:
        key = fitting[0]
        v = rows[key].estimate.variant
        return Recommendation(key, reason(key, rows, ctx.capacity, order), v.overrides + [f"nodes={ctx.nodes}"], [])
    # Nothing fits as asked: a knob before more nodes.
    for key in order:
        est = rows[key].estimate
        if est is None:
            continue
        for override, changes, what in KNOBS:
            if not _knob_applies(est.variant, changes, ctx.device):
                continue
            with_knob = estimate(ctx, est.variant, **changes)
            if with_knob.fits:
                return Recommendation(
                    key, f"no scheme fits on {ctx.nodes} node(s) as asked; {key} does with {what}"
                         f" ({_gb(with_knob.bytes.total)} per device)",
                    est.variant.overrides + [f"nodes={ctx.nodes}", override], [],
                )
    sized = sorted((rows[k].min_nodes, ORDER.index(k), k) for k in order if rows[k].min_nodes)
    if not sized:
        return Recommendation("", "no scheme fits on any node count tried (up to 4096 nodes)", [], [])
    nodes, _, key = sized[0]
    base = ctx.standard(key, nodes)
    hints = _knob_hints(ctx, list(dict.fromkeys([key, "fsdp"])), nodes)
    return Recommendation(key, f"no scheme fits on {ctx.nodes} node(s) as asked; {key} fits on {nodes}"
                               f" ({WHY[key]})", base.overrides + [f"nodes={nodes}"], hints)


def all_rows(ctx: Context) -> dict[str, SchemeRow]:
    return {key: scheme_row(ctx, key) for key in SCHEME_KEYS}

