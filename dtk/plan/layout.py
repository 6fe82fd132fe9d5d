"""Which parameter elements each rank holds under a scheme: pure arithmetic, no torch.

It follows what dtk.parallel does, step by step, so that the planned bytes are the bytes of
the real tensors:

1. pipeline: rank with pipeline index p holds stages p, p + pp, ... (dtk.parallel.pipeline),
   the blocks divided evenly over pp x pp_virtual_stages stages, or at model.split_points;
2. tensor parallel: a tensor with a `tp_dim` is split on it by torch.chunk over tp;
3. FSDP: dim 0 of the (tensor-parallel local) tensor is split by torch.chunk over dp_shard
   (x cp: context-parallel ranks shard too; fully_shard's Shard(0)); replicated over dp_replicate;
4. ZeRO-1: whole tensors are owned by one data-parallel rank each, largest first to the
   least loaded rank (dtk.parallel.zero.partition), per pipeline part.

Ranks are numbered as dtk.mesh.mesh lays them out:
rank = (((dp_replicate_i * pp + pp_i) * dp_shard + dp_shard_i) * cp + cp_i) * tp + tp_i.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from dataclasses import dataclass

from dtk.config.choices import DataParallel
from dtk.config.schema import SchemeConfig
from dtk.plan.degrees import CARVED_FROM, Axis, CarvedAxis, Degrees
from dtk.plan.shape import ModelShape, ParamTensor

Coords = Degrees
"""A rank's coordinate on each mesh axis: one field per Axis, like the degrees."""


def coords(rank: int, d: Degrees) -> Coords:
    """The grid of dtk.mesh.mesh: the innermost axis changes fastest with the rank."""
    values = {}
    for axis in reversed(Axis):
        rank, values[axis.value] = divmod(rank, d.of(axis))
    return Coords(**values)


def rank_of(c: Coords, d: Degrees) -> int:
    """The rank at coordinates `c` (the inverse of `coords`)."""
    rank = 0
    for axis in Axis:
        rank = rank * d.of(axis) + c.of(axis)
    return rank


def axis_groups(d: Degrees, axis: str) -> list[list[int]]:
    """The process groups of one mesh axis: ranks that differ only in that coordinate, each
    in the order of that coordinate (DeviceMesh's groups on the same grid; dtk.topology's
    placement report asks the same)."""
    sizes = dataclasses.asdict(d)
    if axis in CarvedAxis.values():
        return _carved_groups(d, CarvedAxis(axis))
    stride = 1
    for name in reversed(Axis.values()):
        if name == axis:
            break
        stride *= sizes[name]
    size = sizes[axis]
    groups = []
    for rank in range(d.world):
        if (rank // stride) % size == 0:
            groups.append([rank + k * stride for k in range(size)])
    return groups


def _carved_groups(d: Degrees, axis: CarvedAxis) -> list[list[int]]:
    """A carved axis's groups (expert parallelism): blocks of d.ep consecutive ranks of the
    flattened parent axes (dp_shard x cp), as dtk.mesh.mesh.expert_mesh lays them out."""
    names = Axis.values()
    stride = math.prod(d.of(Axis(n)) for n in names[names.index(CARVED_FROM[axis][-1].value) + 1:])
    size, span = d.of(axis), d.parent(axis)
    return [[rank + k * stride for k in range(size)] for rank in range(d.world)
            if (rank // stride) % span % size == 0]


def chunk(n: int, parts: int, index: int) -> int:
    """Length of piece `index` when torch.chunk splits n into `parts` (the last ones may be short or empty)."""
    size = math.ceil(n / parts) if n else 0
    return max(0, min(size, n - index * size))


# Which data-parallel wrapper a job gets: decided here, for the budget and for
# dtk.parallel.parallelize and the worker's optimizer alike.
def uses_fsdp(scheme: SchemeConfig, d: Degrees) -> bool:
    """fully_shard when data-parallel, or alone: a one-process fsdp job still runs it (on a
    one-rank mesh), with the same mixed-precision policy and memory layout as on many GPUs."""
    return scheme.data_parallel == DataParallel.fsdp and (d.dp * d.cp > 1 or d.world == 1)


def uses_ddp(scheme: SchemeConfig, d: Degrees) -> bool:
    """DDP's wrapper only where there is something to all-reduce."""
    return scheme.data_parallel == DataParallel.ddp and d.dp > 1


def uses_zero1(scheme: SchemeConfig, d: Degrees) -> bool:
    """ZeRO-1: the optimizer state sharded over the data-parallel ranks of DDP."""
    return scheme.shard_optimizer and uses_ddp(scheme, d)


def zero1_reduces_gradients(scheme: SchemeConfig, d: Degrees) -> bool:
    """ZeRO-1 with tensor parallelism: the parts are DTensors, which DDP's wrapper does not
    replicate, so there is no wrapper and the ZeRO-1 optimizer all-reduces the gradients
    over the data-parallel ranks itself (dtk.parallel.zero). The same bytes and traffic as
    DDP's all-reduce, which is what the budget counts (uses_ddp)."""
    return uses_zero1(scheme, d) and d.tp > 1


def reshards_after_forward(scheme: SchemeConfig, d: Degrees) -> bool:
    """Whether FSDP frees a unit's gathered parameters after its forward (ZeRO-3):
    `scheme.reshard_after_forward` when set; unset, yes except with pp > 1 (torchtitan's
    "default" policy). A pipeline step runs every micro-batch's forward and backward, and
    torch's pipelining defers each stage's reshard and reduce-scatter to the step's end;
    resharding after forward would only all-gather the stage again for each micro-batch.
    dtk.parallel.parallelize applies it, the budget counts its memory and traffic."""
    if scheme.reshard_after_forward is not None:
        return scheme.reshard_after_forward
    return d.pp == 1


def stage_units(units: tuple[tuple[str, bool], ...], split_points: tuple[str, ...], num_stages: int) -> list[list[str]]:
    """Unit paths of each pipeline stage: at the split points, else the blocks divided evenly
    (the stage starts at block s x blocks // stages). dtk.parallel.pipeline cuts the model
    with this function, after checking the split points against the model."""
    names = [name for name, _ in units]
    if split_points and num_stages > 1:  # one stage (pp=1) ignores them, as the workers do
        starts = [names.index(p) for p in split_points]
    else:
        blocks = [i for i, (_, is_block) in enumerate(units) if is_block]
        starts = [blocks[s * len(blocks) // num_stages] for s in range(1, num_stages)]
    bounds = [0, *starts, len(names)]
    return [names[bounds[s] : bounds[s + 1]] for s in range(num_stages)]


def local_stage_ids(pp_index: int, pp: int, virtual: int) -> list[int]:
    """The stages pipeline index `pp_index` holds: its own, then every pp-th after it (interleaved)."""
    return [pp_index + k * pp for k in range(virtual)]


@dataclass(frozen=True)
class Held:
    """One parameter tensor as a rank holds it."""

    tensor: ParamTensor
    numel: int
    """Elements of this rank's piece (its local tensor)."""
    unsharded_numel: int
    """Elements after FSDP's all-gather (tensor-parallel local): what compute sees."""
    grad_numel: int
    """Elements of its gradient on this rank."""
    part: int
    """Index of the pipeline stage (model part) of this rank that holds it."""


@dataclass(frozen=True)
class RankLayout:
    held: tuple[Held, ...]
    optimizer_numel: int
    """Elements this rank's optimizer keeps state for (all held ones, or its ZeRO-1 share)."""
    optimizer_tensors: int
    """Tensors this rank's optimizer keeps state for (each has its own step counter)."""
    stage_ids: tuple[int, ...]
    num_stages: int


def _tp_local(t: ParamTensor, tp: int, tp_index: int) -> tuple[int, ...]:
    if tp == 1 or t.tp_dim is None:
        return t.shape
    shape = list(t.shape)
    shape[t.tp_dim] = chunk(shape[t.tp_dim], tp, tp_index)
    return tuple(shape)


@functools.lru_cache(maxsize=64)
def zero1_owner(numels: tuple[int, ...], num_ranks: int) -> tuple[int, ...]:
    """dtk.parallel.zero.partition on numbers: largest first, to the least loaded rank
    (ties: the lowest rank), with a heap of (load, rank) so that it stays fast on many ranks."""
    heap = [(0, r) for r in range(num_ranks)]
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        load, rank = heapq.heappop(heap)
        owner[i] = rank
        heapq.heappush(heap, (load + numels[i], rank))
    return tuple(owner)


def rank_layout(shape: ModelShape, scheme: SchemeConfig, d: Degrees, rank: int,
                split_points: tuple[str, ...] = ()) -> RankLayout:
    """What one rank holds: its tensors (sharded as the scheme shards them), its stages and
    its optimizer's share. Kept per shape, by everything it depends on."""
    virtual = scheme.pp_virtual_stages if d.pp > 1 else 1
    key = (d, rank, tuple(split_points), virtual, uses_fsdp(scheme, d), uses_zero1(scheme, d))
    found = shape.layouts.get(key)
    if found is None:
        found = shape.layouts[key] = _rank_layout(shape, d, rank, tuple(split_points), virtual, *key[4:])
    return found


class RankClasses:
    """What tells a rank's layout (`_rank_layout`) from another's: its pipeline and tensor
    coordinates, under FSDP the sizes of its shards (over dp_shard x cp: only the first dims
    of its tensors decide them, and most shards are of equal size) and under ZeRO-1 its index.
    Ranks of one class hold the same bytes, so a budget of every rank is one per class."""

    def __init__(self, shape: ModelShape, d: Degrees, *, fsdp: bool, zero1: bool) -> None:
        self.shape, self.d, self.fsdp, self.zero1 = shape, d, fsdp, zero1
        self._first_dims: dict[int, tuple[int, ...]] = {}  # per tp index

    def of(self, rank: int) -> tuple[int, ...]:
        d, c = self.d, coords(rank, self.d)
        shards: tuple[int, ...] = ()
        if self.fsdp:
            if c.tp not in self._first_dims:
                self._first_dims[c.tp] = tuple(sorted({local[0] for t in self.shape.tensors
                                                       if (local := _tp_local(t, d.tp, c.tp))}))
            index = c.dp_shard * d.cp + c.cp
            shards = tuple(chunk(n, d.dp_shard * d.cp, index) for n in self._first_dims[c.tp])
        return (c.pp, c.tp, *shards, c.dp_replicate * d.dp_shard + c.dp_shard if self.zero1 else -1)


def _rank_layout(shape: ModelShape, d: Degrees, rank: int, split_points: tuple[str, ...], virtual: int,
                 fsdp: bool, zero1: bool) -> RankLayout:
    c = coords(rank, d)
    num_stages = d.pp * virtual
    if d.pp > 1:
        per_stage = stage_units(shape.units, split_points, num_stages)
        ids = local_stage_ids(c.pp, d.pp, virtual)
        unit_part = {u: k for k, sid in enumerate(ids) for u in per_stage[sid]}
    else:
        ids = [0]
        unit_part = {u: 0 for u, _ in shape.units}
    held: list[Held] = []
    for t in shape.tensors:
        if t.unit not in unit_part:
            if t.unit:
                continue  # another pipeline stage's
            unit_part[t.unit] = 0  # a parameter of the root module itself: every stage keeps it
        local = _tp_local(t, d.tp, c.tp)
        full = math.prod(local)
        numel = grad = full
        if fsdp and local:
            # over dp_shard x cp, dp_shard outer (dtk.mesh.mesh's flattened dp_shard_cp)
            numel = grad = chunk(local[0], d.dp_shard * d.cp, c.dp_shard * d.cp + c.cp) * math.prod(local[1:])
        elif t.embedding and t.tp_dim is not None and d.tp > 1:
            grad = t.numel  # the row-split embedding's gradient arrives whole on every rank
        held.append(Held(t, numel, full, grad, unit_part[t.unit]))
    opt_numel, opt_tensors = sum(h.numel for h in held), len(held)
    if zero1:
        dp_index = c.dp_replicate * d.dp_shard + c.dp_shard
        if shape.exact:
            mine = []
            for part in range(len(ids)):
                in_part = [h for h in held if h.part == part]
                owners = zero1_owner(tuple(h.numel for h in in_part), d.dp)
                mine += [h for h, o in zip(in_part, owners, strict=True) if o == dp_index]
            opt_numel, opt_tensors = sum(h.numel for h in mine), len(mine)
        else:  # stand-in tensors: whole-tensor ownership would mean nothing, an even share
            opt_numel = sum(chunk(h.numel, d.dp, dp_index) for h in held)
    return RankLayout(tuple(held), opt_numel, opt_tensors, tuple(ids), num_stages)


def tied_copy_numel(shape: ModelShape, scheme: SchemeConfig, d: Degrees, layout: RankLayout) -> int:
    """Elements of the second copy of a tied weight a rank holds. The shape counts a tied
    weight once, under its first name (the token embedding, a tensor both `embedding` and
    `matmul`); under a pipeline the output head tied to it is on the last stage, another
    pipeline rank's, which holds, steps and all-reduces its own copy (dtk.parallel.stage_ties):
    its parameters, gradient and optimizer state (dtk.plan.cost.memory counts them). The head is
    split over tp by the vocabulary and sharded by FSDP like the other weights."""
    if d.pp == 1 or layout.num_stages - 1 not in layout.stage_ids:
        return 0
    held_units = {h.tensor.unit for h in layout.held}
    copies = 0
    for t in shape.tensors:
        if t.embedding and t.matmul and t.unit not in held_units:
            local = -(-t.numel // d.tp)
            copies += -(-local // (d.dp_shard * d.cp)) if uses_fsdp(scheme, d) else local
    return copies
