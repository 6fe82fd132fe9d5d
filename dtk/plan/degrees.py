"""The mesh axes and their degrees: `dp_replicate x pp x dp_shard x cp x tp = world size`, one may be -1.

`Axis` is the one list of axis names: the scheme's degree keys, the named DeviceMesh's
dimensions (dtk/mesh/mesh.py builds it in this order) and what the plan prints all come
from it. Torch-free, so the login node checks the degrees before anything is queued.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dtk.common.errors import UserError
from dtk.config.choices import Choice, DataParallel, PipelineSchedule
from dtk.config.convert import builtin_transformer
from dtk.config.hf_json import HF_TARGET
from dtk.config.schema import ModelConfig, SchemeConfig, TransformerConfig
from dtk.plan.shape import ffn_hidden_size


class Axis(Choice):
    """Mesh axes in grid order, outermost first (dtk/mesh/mesh.py draws the grid). Each is a
    degree key of the scheme (`scheme.tp`) and a field of Degrees."""

    dp_replicate = "dp_replicate"
    pp = "pp"
    dp_shard = "dp_shard"
    cp = "cp"
    tp = "tp"


# Per axis: the kind of traffic it carries, and what travels how often (the topology report
# prints both beside each axis's span).
TRAFFIC: dict[Axis, tuple[str, str]] = {
    Axis.dp_replicate: ("data-parallel gradients", "gradients: one all-reduce per step (DDP, or HSDP's replicas)"),
    Axis.pp: ("pipeline activations", "activations: point-to-point per micro-batch between neighbouring stages"),
    Axis.dp_shard: ("sharded parameters and gradients",
                    "parameters and gradients: FSDP all-gather and reduce-scatter per block"),
    Axis.cp: ("context-parallel keys and values",
              "activations: all-gather of each block's keys and values per micro-batch, reduce-scatter of their"
              " gradients"),
    Axis.tp: ("tensor-parallel activations", "activations: all-reduce / all-gather inside every block, forward and backward"),
}

class CarvedAxis(Choice):
    """Axes carved out of grid axes (not a factor of the world size): their ranks are a
    block of consecutive ranks of the flattened parent axes, innermost first
    (dtk/mesh/mesh.py builds the carved mesh, dtk.plan.layout groups the ranks alike)."""

    ep = "ep"


# Per carved axis: the grid axes it is carved out of, in grid order, and its traffic.
CARVED_FROM: dict[CarvedAxis, tuple[Axis, ...]] = {CarvedAxis.ep: (Axis.dp_shard, Axis.cp)}
CARVED_TRAFFIC: dict[CarvedAxis, tuple[str, str]] = {
    CarvedAxis.ep: ("expert-parallel tokens", "activations: all-to-all of routed tokens to their experts and back,"
                    " forward and backward, in every MoE block"),
}

WHATIF_TARGET = "(what-if: plan.*)"
"""The model the checks see for a what-if job (plan.params, plan.layers, ...): a stand-in of a
transformer, which every scheme may split."""

DP = "dp"
"""The flattened (dp_replicate, dp_shard) mesh: the ranks that see different samples."""
DATA_AXES = (Axis.dp_replicate, Axis.dp_shard)


@dataclass(frozen=True)
class Degrees:
    """The size of each mesh axis, one field per Axis. `cp` is last and defaults to 1 (the
    grid's order is Axis's, not the fields'): a layout without context parallelism is written
    as before it existed."""

    dp_replicate: int
    pp: int
    dp_shard: int
    tp: int
    cp: int = 1
    ep: int = 1
    """Carved out of dp_shard x cp (CarvedAxis): not a factor of `world`."""

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different samples (the DATA_AXES)."""
        return math.prod(self.of(axis) for axis in DATA_AXES)

    @property
    def world(self) -> int:
        return math.prod(self.of(axis) for axis in Axis)

    def of(self, axis: Axis | CarvedAxis) -> int:
        return getattr(self, axis.value)

    def parent(self, axis: CarvedAxis) -> int:
        """The size of the grid axes `axis` is carved out of (dp_shard x cp for ep)."""
        return math.prod(self.of(a) for a in CARVED_FROM[axis])

    def describe(self) -> str:
        """`dp_replicate=2 pp=1 dp_shard=2 cp=1 tp=2`, in grid order; a carved axis after, when used."""
        carved = [f"{axis}={self.of(axis)}" for axis in CarvedAxis if self.of(axis) > 1]
        return " ".join([f"{axis}={self.of(axis)}" for axis in Axis] + carved)


def resolve_degrees(scheme: SchemeConfig, world: int) -> Degrees:
    """Infer the one `-1` degree and check that the product is the world size."""
    values = {axis.value: getattr(scheme, axis.value) for axis in Axis}
    inferred = [axis for axis, v in values.items() if v == -1]
    for axis, v in values.items():
        if v != -1 and (not isinstance(v, int) or v < 1):
            raise UserError(f"scheme.{axis}={v}: expected a positive integer or -1 (inferred)")
    if len(inferred) > 1:
        raise UserError(
            f"scheme degrees {', '.join(f'{a}=-1' for a in inferred)}: at most one degree may be -1 (inferred)"
        )
    known = 1
    for v in values.values():
        if v != -1:
            known *= v
    formula = " x ".join(f"{a}={v}" for a, v in values.items())
    if inferred:
        if world % known:
            raise UserError(
                f"{formula}: the fixed degrees multiply to {known}, which does not divide world size {world}"
                f" (nodes x tasks_per_node)"
            )
        values[inferred[0]] = world // known
    elif known != world:
        raise UserError(
            f"{formula} = {known}, but the world size (nodes x tasks_per_node) is {world};"
            " make the product equal, or set one degree to -1"
        )
    return _carve(Degrees(**values), scheme)


def _carve(grid: Degrees, scheme: SchemeConfig) -> Degrees:
    """The carved axes' degrees (scheme.ep), each dividing the grid axes it is carved out of."""
    carved: dict[str, int] = {}
    for axis in CarvedAxis:
        value, parents = getattr(scheme, axis.value), CARVED_FROM[axis]
        size = math.prod(grid.of(a) for a in parents)
        if not isinstance(value, int) or value < 1:
            raise UserError(f"scheme.{axis}={value}: expected a positive integer")
        if size % value:
            names = " x ".join(f"{a}={grid.of(a)}" for a in parents)
            ok = [d for d in range(1, size + 1) if size % d == 0]
            raise UserError(
                f"scheme.{axis}={value} does not divide {names} = {size}: the {axis} ranks are carved out of"
                f" those ranks; try scheme.{axis} in {ok}"
            )
        carved[axis.value] = value
    return dataclasses.replace(grid, **carved)


def micro_batch_size(scheme: SchemeConfig, *, micro_batch: int | None, global_batch: int, degrees: Degrees) -> int:
    """Samples per forward on one rank. scheme.pp_microbatches, when set, decides it:
    global_batch = micro_batch x pp_microbatches x data-parallel size. With a pipeline and
    neither set, the pipeline gets 2 x its stage count of micro-batches."""
    n = scheme.pp_microbatches
    if not n and not micro_batch and degrees.pp > 1:
        # Neither given: enough micro-batches to keep the stages busy (bubble <= ~1/3).
        local, stages = global_batch // degrees.dp, degrees.pp * scheme.pp_virtual_stages
        n = next((c for c in (2 * stages, stages) if local % c == 0), 0)
    if not n:
        return micro_batch or global_batch // degrees.dp
    if n < 0:
        raise UserError(f"scheme.pp_microbatches={n}: expected 0 (from train.micro_batch) or a positive count")
    per = n * degrees.dp
    if global_batch % per:
        raise UserError(
            f"train.global_batch={global_batch} is not a multiple of scheme.pp_microbatches x data-parallel size"
            f" = {n} x {degrees.dp} = {per}; try train.global_batch={per * max(1, round(global_batch / per))}"
        )
    derived = global_batch // per
    if micro_batch and micro_batch != derived:
        raise UserError(
            f"train.micro_batch={micro_batch} contradicts scheme.pp_microbatches={n}: global batch {global_batch}"
            f" / ({n} micro-batches x data-parallel {degrees.dp}) = {derived}; set only one of them"
        )
    return derived


def check_scheme(
    scheme: SchemeConfig, degrees: Degrees, model: ModelConfig, *, num_microbatches: int, eval_every: int
) -> None:
    """The scheme's options together, and the degrees against the model's shape (the built-in
    transformer's numbers; a user model is checked when it is built). Each option's own
    allowed values were checked while composing (dtk/config/choices.py)."""
    zero1_tp = scheme.shard_optimizer and degrees.dp_shard == 1 and degrees.tp > 1
    if scheme.data_parallel == DataParallel.ddp and (degrees.dp_shard > 1 or degrees.tp > 1) and not zero1_tp:
        raise UserError(
            f"scheme.data_parallel=ddp with dp_shard={degrees.dp_shard}, tp={degrees.tp}: DDP replicates whole"
            " (non-DTensor) models; use scheme.data_parallel=fsdp, or dp_shard=1 and tp=1"
        )
    if scheme.shard_optimizer and scheme.data_parallel != DataParallel.ddp:
        raise UserError(
            "scheme.shard_optimizer=true is ZeRO-1 over DDP; with data_parallel=fsdp the optimizer state is"
            " already sharded (set shard_optimizer=false)"
        )
    if scheme.bucket_cap_mb < 1:
        raise UserError(f"scheme.bucket_cap_mb={scheme.bucket_cap_mb}: expected a positive size in MiB")
    virtual = scheme.pp_virtual_stages
    if virtual < 1:
        raise UserError(f"scheme.pp_virtual_stages={virtual}: expected a positive integer")
    interleaved = scheme.pp_schedule == PipelineSchedule("interleaved_1f1b")
    if interleaved and virtual < 2 and degrees.pp > 1:
        raise UserError(
            "scheme.pp_schedule=interleaved_1f1b needs scheme.pp_virtual_stages >= 2 (stages per pipeline rank);"
            " with 1 use scheme.pp_schedule=1f1b"
        )
    if not interleaved and virtual != 1:
        raise UserError(
            f"scheme.pp_virtual_stages={virtual} needs scheme.pp_schedule=interleaved_1f1b"
            f" ({scheme.pp_schedule} runs one stage per pipeline rank)"
        )
    transformer = builtin_transformer(model)
    if transformer is not None:
        _check_tp(degrees.tp, transformer)
    _check_pp(scheme, degrees.pp, model, transformer, num_microbatches=num_microbatches)
    _check_cp(scheme, degrees, model, transformer)
    _check_moe(scheme, degrees, model, transformer)
    if degrees.pp > 1 and eval_every:
        raise UserError(
            f"train.eval_every={eval_every} with scheme.pp={degrees.pp}: evaluation runs the whole model's"
            " forward on one rank, which a pipeline rank does not hold; set train.eval_every=0"
        )


def _check_tp(tp: int, model: TransformerConfig) -> None:
    if tp == 1:
        return
    if model.dropout > 0:
        raise UserError(
            f"model.dropout={model.dropout} with scheme.tp={tp}: tensor-parallel ranks would draw different"
            " dropout masks for the same activations; set model.dropout=0 or scheme.tp=1"
        )
    sizes = {"model.num_heads": model.num_heads, "model.dim": model.dim}
    if model.ffn_hidden:
        sizes["model.ffn_hidden"] = model.ffn_hidden
    else:
        sizes["feed-forward hidden size (model.ffn_hidden=0: 8/3 x dim, rounded up to 16)"] = ffn_hidden_size(
            model.dim, 0
        )
    sizes["model.vocab_size"] = model.vocab_size
    sizes["model.seq_len"] = model.seq_len  # the position table is split by rows too
    common = math.gcd(*sizes.values())
    for key, size in sizes.items():
        if size % tp:
            ok = [d for d in range(1, min(common, 64) + 1) if common % d == 0]
            raise UserError(
                f"scheme.tp={tp} does not divide {key}={size} ({size} / {tp} = {size / tp:.2f});"
                f" tensor parallelism splits it evenly: try scheme.tp in {ok}"
            )


def _check_cp(scheme: SchemeConfig, degrees: Degrees, model: ModelConfig, transformer: TransformerConfig | None) -> None:
    """Context parallelism as the runtime builds it (dtk.parallel.cp): the built-in transformer
    or a Hugging Face model, under FSDP over dp_shard x cp (a pipeline too), without compile or
    sequence parallelism yet."""
    cp = degrees.cp
    if cp == 1:
        return
    if transformer is None and model._target_ not in (HF_TARGET, WHATIF_TARGET):
        raise UserError(
            f"scheme.cp={cp}: context parallelism runs the built-in transformer and model=hf; the attention of"
            f" model._target_={model._target_} does not gather the other ranks' keys; use scheme.cp=1"
        )
    seq_len = transformer.seq_len if transformer is not None else model.seq_len
    if seq_len is not None and seq_len % (2 * cp):
        ok = [c for c in range(1, 17) if seq_len % (2 * c) == 0]
        raise UserError(
            f"scheme.cp={cp} does not fit model.seq_len={seq_len}: each sequence is cut into 2 x cp ="
            f" {2 * cp} equal chunks ({seq_len} / {2 * cp} = {seq_len / (2 * cp):.2f}); try scheme.cp in {ok}"
        )
    if scheme.data_parallel != DataParallel.fsdp:
        raise UserError(
            f"scheme.cp={cp} with scheme.data_parallel={scheme.data_parallel}: context-parallel ranks hold parts of"
            " the same samples and reduce their gradients with FSDP over dp_shard x cp; use"
            " scheme.data_parallel=fsdp"
        )
    unsupported = {"scheme.compile": (scheme.compile, "true", "scheme.compile=false"),
                   "scheme.sequence_parallel": (scheme.sequence_parallel, "true", "scheme.sequence_parallel=false")}
    for key, (on, value, instead) in unsupported.items():
        if on:
            raise UserError(
                f"{key}={value} with scheme.cp={cp}: context parallelism does not run with it yet; set {instead}"
                " or scheme.cp=1"
            )


def _check_moe(scheme: SchemeConfig, degrees: Degrees, model: ModelConfig,
               transformer: TransformerConfig | None) -> None:
    """The mixture of experts' keys (model=moe) and expert parallelism as dtk.parallel.ep builds
    it: the built-in MoE transformer, its experts split evenly, under FSDP."""
    experts = transformer.num_experts if transformer is not None else 0
    if transformer is not None and experts:
        _check_experts(transformer, degrees)
    ep = degrees.ep
    if ep == 1:
        return
    if not experts:
        what = "model=hf" if model._target_ == HF_TARGET else f"model._target_={model._target_} without experts"
        raise UserError(
            f"scheme.ep={ep} with {what}: expert parallelism splits the experts of the built-in mixture of"
            " experts (model=moe, model.num_experts > 0); use model=moe or scheme.ep=1"
        )
    if experts % ep:
        ok = [d for d in range(1, experts + 1) if experts % d == 0 and degrees.parent(CarvedAxis.ep) % d == 0]
        raise UserError(
            f"scheme.ep={ep} does not divide model.num_experts={experts}: each ep rank holds num_experts / ep"
            f" experts; try scheme.ep in {ok}"
        )
    if scheme.data_parallel != DataParallel.fsdp or scheme.cpu_offload:
        raise UserError(
            f"scheme.ep={ep} with scheme.data_parallel={scheme.data_parallel}"
            f"{' and scheme.cpu_offload=true' if scheme.cpu_offload else ''}: expert parallelism runs under FSDP"
            " over dp_shard x cp without offload; use scheme.data_parallel=fsdp scheme.cpu_offload=false"
        )


def _check_experts(model: TransformerConfig, degrees: Degrees) -> None:
    if model.num_experts < 0 or model.aux_loss_weight < 0 or model.capacity_factor < 0:
        raise UserError(
            f"model.num_experts={model.num_experts}, model.aux_loss_weight={model.aux_loss_weight},"
            f" model.capacity_factor={model.capacity_factor}: expected values >= 0"
        )
    if not 1 <= model.top_k <= model.num_experts:
        raise UserError(
            f"model.top_k={model.top_k} with model.num_experts={model.num_experts}: each token goes to top_k"
            f" different experts; try model.top_k in 1..{model.num_experts}"
        )
    for key, degree in (("scheme.tp", degrees.tp), ("scheme.pp", degrees.pp)):
        if degree > 1:
            raise UserError(
                f"{key}={degree} with model.num_experts={model.num_experts}: the mixture of experts does not run"
                f" with it yet (no tensor-parallel experts, no load-balancing loss on a pipeline's last stage);"
                f" set {key}=1"
            )


def check_cp_task(degrees: Degrees, task_target: str | None) -> None:
    """Context parallelism cuts token rows (task=lm) into each rank's slice; a user's task it cannot cut."""
    if degrees.cp > 1 and task_target is not None:
        raise UserError(
            f"scheme.cp={degrees.cp} with task._target_={task_target}: context parallelism cuts token rows"
            " (task=lm) into each rank's slice, a user's batch it cannot cut; use task=lm, or scheme.cp=1"
        )


def _check_pp(
    scheme: SchemeConfig, pp: int, model: ModelConfig, transformer: TransformerConfig | None, *, num_microbatches: int
) -> None:
    if pp == 1:
        return
    virtual = scheme.pp_virtual_stages
    stages = pp * virtual
    split_points = model.split_points
    if split_points and len(split_points) + 1 != stages:
        raise UserError(
            f"model.split_points has {len(split_points)} entries = {len(split_points) + 1} stages, but"
            f" scheme.pp x scheme.pp_virtual_stages = {pp} x {virtual} = {stages}; give {stages - 1} split points"
            " or none (even split of the blocks)"
        )
    if not split_points and transformer is not None and stages > transformer.num_layers:
        raise UserError(
            f"scheme.pp x scheme.pp_virtual_stages = {pp} x {virtual} = {stages} pipeline stages, but"
            f" model.num_layers={transformer.num_layers}: each stage needs at least one layer;"
            f" use at most {transformer.num_layers} stages"
        )
    schedule = scheme.pp_schedule
    if schedule == PipelineSchedule("1f1b") and num_microbatches < pp:
        raise UserError(
            f"scheme.pp_schedule=1f1b with {num_microbatches} micro-batches per step (global batch / (micro batch x"
            f" data-parallel size)) < pp={pp}: 1F1B needs at least one micro-batch per stage; raise"
            " scheme.pp_microbatches or lower train.micro_batch"
        )
    if schedule == PipelineSchedule("interleaved_1f1b"):
        rounds = max(1, num_microbatches // pp)
        if num_microbatches % rounds:
            raise UserError(
                f"scheme.pp_schedule=interleaved_1f1b with {num_microbatches} micro-batches and pp={pp}:"
                f" the micro-batches must split into {rounds} equal rounds of pp ({num_microbatches} % {rounds} ="
                f" {num_microbatches % rounds}); use a multiple of pp={pp}"
            )
