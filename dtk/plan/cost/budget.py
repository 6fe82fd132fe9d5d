"""The memory budget of a job: every scheme at the job's size and the smallest size at
which each fits. Reads the composed config once (`Context.from_config`); the rest is
arithmetic on dtk.plan.cost.memory. What to recommend is dtk.plan.cost.search's: every layout,
checkpointing, offload and micro-batch, ranked by fit, nodes, predicted step time and
simplicity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtk.common.errors import UserError
from dtk.config.schema import ModelConfig
from dtk.plan.cost.exchange import Exchange
from dtk.plan.cost.memory import Job, RankBytes, device_bytes, precision_for, scheme_config
from dtk.plan.cost.variants import SCHEME_KEYS, Variant, checked_scheme, make_variant, standard_scheme
from dtk.plan.cost.whatif import check_whatif
from dtk.plan.degrees import resolve_degrees
from dtk.plan.shape import ModelShape

# Node counts tried when looking for the smallest that fits: every count up to 64, then
# steps of an eighth of a power of two up to 4096.
NODE_CANDIDATES = tuple(range(1, 65)) + tuple(
    sorted({p + k * p // 8 for p in (64, 128, 256, 512, 1024, 2048) for k in range(1, 9)})
)
# Tie-break of schemes that fit on equally few nodes (dtk.plan.cost.gate's error line): simplest first.
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
    memory_snapshots: bool = False
    sync: Exchange = Exchange()
    """How the replicas exchange (+sync; the default: every step)."""

    def job(self, v: Variant, **changes: Any) -> Job:
        scheme = scheme_config(dict(v.scheme, **changes))
        return Job(
            scheme=scheme, degrees=v.degrees, micro_batch=v.micro_batch, num_micro=v.num_micro, device=self.device,
            precision=precision_for(scheme, self.device, self.plan_keys), async_checkpoint=self.async_checkpoint,
            split_points=self.split_points, memory_snapshots=self.memory_snapshots, sync=self.sync,
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
        stages = v.degrees.pp * scheme_config(v.scheme).pp_virtual_stages if v.degrees.pp > 1 else 1
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


@dataclass(frozen=True)
class Recommendation:
    """What dtk.plan.cost.search recommends, as the report, the OOM line and plan.md print it."""

    scheme: str
    reason: str
    overrides: list[str]
    hints: list[str]


def all_rows(ctx: Context) -> dict[str, SchemeRow]:
    return {key: scheme_row(ctx, key) for key in SCHEME_KEYS}

