"""Parallel degrees: `dp_replicate × dp_shard × tp × pp = world size`, one of them may be -1."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dtk.errors import UserError

AXES = ("dp_replicate", "dp_shard", "tp", "pp")


@dataclass(frozen=True)
class Degrees:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp


def resolve_degrees(scheme: dict[str, Any], world: int) -> Degrees:
    """Infer the one `-1` degree and check that the product is the world size."""
    values = {axis: scheme[axis] for axis in AXES}
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
    formula = " × ".join(f"{a}={values[a]}" for a in AXES)
    if inferred:
        if world % known:
            raise UserError(
                f"{formula}: the fixed degrees multiply to {known}, which does not divide world size {world}"
                f" (nodes × tasks_per_node)"
            )
        values[inferred[0]] = world // known
    elif known != world:
        raise UserError(
            f"{formula} = {known}, but the world size (nodes × tasks_per_node) is {world};"
            " make the product equal, or set one degree to -1"
        )
    return Degrees(**values)


# What each scheme option may be; checked here so a typo fails on the login node.
DATA_PARALLEL = ("ddp", "fsdp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
AC_MODES = ("none", "selective", "full")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def default_scheme() -> dict[str, Any]:
    """The scheme of a job without `+scheme=`: plain DDP (the schema's defaults)."""
    from dataclasses import asdict

    from dtk.config.schema import SchemeConfig

    return asdict(SchemeConfig())


def micro_batch_size(scheme: dict[str, Any], *, micro_batch: int | None, global_batch: int, degrees: Degrees) -> int:
    """Samples per forward on one rank. scheme.pp_microbatches, when set, decides it:
    global_batch = micro_batch × pp_microbatches × data-parallel size. With a pipeline and
    neither set, the pipeline gets 2 × its stage count of micro-batches."""
    n = scheme.get("pp_microbatches", 0)
    if not n and not micro_batch and degrees.pp > 1:
        # Neither given: enough micro-batches to keep the stages busy (bubble ≤ ~1/3).
        local, stages = global_batch // degrees.dp, degrees.pp * scheme.get("pp_virtual_stages", 1)
        n = next((c for c in (2 * stages, stages) if local % c == 0), 0)
    if not n:
        return micro_batch or global_batch // degrees.dp
    if n < 0:
        raise UserError(f"scheme.pp_microbatches={n}: expected 0 (from train.micro_batch) or a positive count")
    per = n * degrees.dp
    if global_batch % per:
        raise UserError(
            f"train.global_batch={global_batch} is not a multiple of scheme.pp_microbatches × data-parallel size"
            f" = {n} × {degrees.dp} = {per}; try train.global_batch={per * max(1, round(global_batch / per))}"
        )
    derived = global_batch // per
    if micro_batch and micro_batch != derived:
        raise UserError(
            f"train.micro_batch={micro_batch} contradicts scheme.pp_microbatches={n}: global batch {global_batch}"
            f" / ({n} micro-batches × data-parallel {degrees.dp}) = {derived}; set only one of them"
        )
    return derived


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{key}={value}: expected one of {', '.join(allowed)}")


def check_scheme(
    scheme: dict[str, Any], degrees: Degrees, model: dict[str, Any], *, n_microbatches: int, eval_every: int = 0
) -> None:
    """The scheme's options, and the degrees against the model's shape (the built-in
    transformer's numbers; a user model is checked when it is built)."""
    _one_of("scheme.data_parallel", scheme["data_parallel"], DATA_PARALLEL)
    _one_of("scheme.pp_schedule", scheme["pp_schedule"], PP_SCHEDULES)
    _one_of("scheme.activation_checkpoint", scheme["activation_checkpoint"], AC_MODES)
    _one_of("scheme.param_dtype", scheme["param_dtype"], DTYPES)
    _one_of("scheme.reduce_dtype", scheme["reduce_dtype"], DTYPES)
    if scheme["data_parallel"] == "ddp" and (degrees.dp_shard > 1 or degrees.tp > 1):
        raise UserError(
            f"scheme.data_parallel=ddp with dp_shard={degrees.dp_shard}, tp={degrees.tp}: DDP replicates whole"
            " (non-DTensor) models; use scheme.data_parallel=fsdp, or dp_shard=1 and tp=1"
        )
    if scheme["shard_optimizer"] and scheme["data_parallel"] != "ddp":
        raise UserError(
            "scheme.shard_optimizer=true is ZeRO-1 over DDP; with data_parallel=fsdp the optimizer state is"
            " already sharded (set shard_optimizer=false)"
        )
    if scheme["bucket_cap_mb"] < 1:
        raise UserError(f"scheme.bucket_cap_mb={scheme['bucket_cap_mb']}: expected a positive size in MiB")
    virtual = scheme["pp_virtual_stages"]
    if not isinstance(virtual, int) or virtual < 1:
        raise UserError(f"scheme.pp_virtual_stages={virtual}: expected a positive integer")
    if scheme["pp_schedule"] == "interleaved_1f1b" and virtual < 2 and degrees.pp > 1:
        raise UserError(
            "scheme.pp_schedule=interleaved_1f1b needs scheme.pp_virtual_stages ≥ 2 (stages per pipeline rank);"
            " with 1 use scheme.pp_schedule=1f1b"
        )
    if scheme["pp_schedule"] != "interleaved_1f1b" and virtual != 1:
        raise UserError(
            f"scheme.pp_virtual_stages={virtual} needs scheme.pp_schedule=interleaved_1f1b"
            f" ({scheme['pp_schedule']} runs one stage per pipeline rank)"
        )
    _check_tp(scheme, degrees.tp, model)
    _check_pp(scheme, degrees.pp, model, n_microbatches=n_microbatches)
    if degrees.pp > 1 and eval_every:
        raise UserError(
            f"train.eval_every={eval_every} with scheme.pp={degrees.pp}: evaluation runs the whole model's"
            " forward on one rank, which a pipeline rank does not hold; set train.eval_every=0"
        )


def _check_tp(scheme: dict[str, Any], tp: int, model: dict[str, Any]) -> None:
    if tp == 1 or "n_heads" not in model:
        return
    sizes = {"model.n_heads": model["n_heads"], "model.dim": model["dim"]}
    if model.get("ffn_hidden"):
        sizes["model.ffn_hidden"] = model["ffn_hidden"]
    else:
        sizes["feed-forward hidden size (model.ffn_hidden=0: 8/3 × dim, rounded up to 16)"] = 16 * math.ceil(
            8 * model["dim"] / 3 / 16
        )
    sizes["model.vocab_size"] = model["vocab_size"]
    sizes["model.seq_len"] = model["seq_len"]  # the position table is split by rows too
    common = math.gcd(*sizes.values())
    for key, size in sizes.items():
        if size % tp:
            ok = [d for d in range(1, min(common, 64) + 1) if common % d == 0]
            raise UserError(
                f"scheme.tp={tp} does not divide {key}={size} ({size} / {tp} = {size / tp:.2f});"
                f" tensor parallelism splits it evenly: try scheme.tp in {ok}"
            )


def _check_pp(scheme: dict[str, Any], pp: int, model: dict[str, Any], *, n_microbatches: int) -> None:
    if pp == 1:
        return
    virtual = scheme["pp_virtual_stages"]
    stages = pp * virtual
    split_points = model.get("split_points") or []
    if split_points and len(split_points) + 1 != stages:
        raise UserError(
            f"model.split_points has {len(split_points)} entries = {len(split_points) + 1} stages, but"
            f" scheme.pp × scheme.pp_virtual_stages = {pp} × {virtual} = {stages}; give {stages - 1} split points"
            " or none (even split of the blocks)"
        )
    if not split_points and "n_layers" in model and stages > model["n_layers"]:
        raise UserError(
            f"scheme.pp × scheme.pp_virtual_stages = {pp} × {virtual} = {stages} pipeline stages, but"
            f" model.n_layers={model['n_layers']}: each stage needs at least one layer;"
            f" use at most {model['n_layers']} stages"
        )
    schedule = scheme["pp_schedule"]
    if schedule == "1f1b" and n_microbatches < pp:
        raise UserError(
            f"scheme.pp_schedule=1f1b with {n_microbatches} micro-batches per step (global batch / (micro batch ×"
            f" data-parallel size)) < pp={pp}: 1F1B needs at least one micro-batch per stage; raise"
            " scheme.pp_microbatches or lower train.micro_batch"
        )
    if schedule == "interleaved_1f1b":
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise UserError(
                f"scheme.pp_schedule=interleaved_1f1b with {n_microbatches} micro-batches and pp={pp}:"
                f" the micro-batches must split into {rounds} equal rounds of pp ({n_microbatches} % {rounds} ="
                f" {n_microbatches % rounds}); use a multiple of pp={pp}"
            )
