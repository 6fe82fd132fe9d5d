"""The one composition point of parallelism.

Order, fixed; each step that changes the model is an `apply_*` of its own module:

    0. decide               the dtypes (scheme.param_dtype, reduce_dtype; `auto`: bfloat16
                            and float32 on a GPU, float32 when the GPU has no bfloat16 and
                            on the CPU; dtk.parallel.precision), FSDP or DDP (the
                            planner's rule, dtk.plan.layout), the TP plan checked on the whole
                            model (dtk.parallel.tp.check_tp_plan: a plan, styles dtk has, every
                            pattern matching a module), and whether logits stay sharded
    1. pipeline split       the (meta) model -> this rank's stage modules (the planner's cut)
    2. tensor parallel      DTensor-shard the matmuls of each stage (DTensor on the tp axis);
                            a tied weight (embedding and output head) is one DTensor again
    2b. context parallel    the model's attention gathers the cp group's keys and values, its
                            positions are the full sequence's (dtk.parallel.cp; only attributes)
    3. activation ckpt      wrap each block's forward (after TP: the recomputed region is the sharded block)
    4. compile              each block, in place (after AC, so the checkpoint is in the graph)
    4b. experts             MoE blocks count their routing over the step's ranks; with ep > 1
                            their experts split over ep, FSDP over the rest (dtk.parallel.ep)
    5. FSDP                 shard each block over dp_shard (x cp: dtk.mesh.mesh's dp_shard_cp;
                            HSDP: replicate over dp_replicate),
                            with the dtypes of step 0 as its mixed-precision policy; with
                            pp > 1 kept gathered through the pipeline step unless
                            scheme.reshard_after_forward says otherwise (the planner's rule,
                            dtk.plan.layout.reshards_after_forward)
    6. materialize          storage and initial values, by the caller's `materialize` (after
                            sharding: no rank ever holds the whole model; before DDP, which
                            broadcasts real weights); with FSDP's CPU offload the shards on
                            the host, buffers on the device
    7. DDP                  or wrap each part for replicated data parallelism (dp > 1)
    8. autocast             without FSDP, a low-precision param_dtype runs forward under
                            autocast; a pipeline's stages enter it themselves and send in it
    9. pipeline schedule    stages of this rank -> the schedule that runs the micro-batches;
                            a weight tied across stages has its copies' gradients summed
                            after each step (dtk.parallel.stage_ties)

This function only decides which apply runs, and in what order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtk.config.choices import ActivationCheckpoint
from dtk.config.schema import SchemeConfig
from dtk.mesh.mesh import ParallelMesh
from dtk.models.build import ParallelSpec
from dtk.models.ties import retie, tied_groups
from dtk.parallel.pipeline import Pipeline, build_pipeline, split_model
from dtk.parallel.precision import resolve_dtype
from dtk.parallel.stage_ties import StageTie
from dtk.plan.degrees import Axis
from dtk.plan.layout import reshards_after_forward, uses_ddp, uses_fsdp, zero1_reduces_gradients


@dataclass
class Parallelized:
    """The model as this rank holds it."""

    parts: list[nn.Module]
    """One module, or one per pipeline stage this rank holds (interleaved schedules: several)."""
    pipeline: Pipeline | None
    """The pipeline schedule when pp > 1."""
    autocast_dtype: torch.dtype | None
    """Run forward under autocast to this dtype (mixed precision without FSDP's policy). A
    pipeline's stages enter it themselves (dtk.parallel.pipeline.autocast_stage)."""
    loss_parallel: bool = False
    """The model's output is a DTensor sharded over the vocabulary (tensor parallel): the
    loss and its backward run under torch's loss_parallel (dtk.parallel.tp)."""
    comm_states: list[Any] = field(default_factory=list)
    """PowerSGD's state of each DDP part (scheme.grad_compression=powersgd, dtk.parallel.compression)."""


@dataclass(frozen=True)
class _Decided:
    """Step 0's decisions, which the later steps only read."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    use_fsdp: bool
    use_ddp: bool
    loss_parallel: bool
    local_replicas: bool


def parallelize(
    model: nn.Module,
    *,
    mesh: ParallelMesh,
    scheme: SchemeConfig,
    spec: ParallelSpec,
    device: torch.device,
    materialize: Callable[[list[nn.Module], torch.device], None],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_microbatches: int,
    sharded_logits: bool,
    local_replicas: bool = False,
) -> Parallelized:
    """Return this rank's model ready to train under `scheme`, by the steps of the module doc.
    `model` is on the meta device; `materialize(parts, on)` gives parts storage on device `on`
    and initial values (step 6); `loss_fn` is the run's loss, which a pipeline schedule calls on its last
    stage; `sharded_logits`: the run's task takes logits sharded over the vocabulary (tensor
    parallel then keeps them sharded: `Parallelized.loss_parallel`, on a pipeline's last stage too).
    Raises UserError for param_dtype=bfloat16 on a GPU without it and for a model's tp_plan
    style dtk has no equivalent of; ValueError for a tp_plan that is missing or names no
    module, and for split points that do not fit the model. `local_replicas`: the
    dp_replicate replicas step on their own and synchronize every few steps (dtk.train.sync):
    no DDP, and FSDP shards over dp_shard inside a replica only."""
    # 0. decide
    decided = _decide(model, mesh=mesh, scheme=scheme, spec=spec, device=device,
                      sharded_logits=sharded_logits, local_replicas=local_replicas)
    degrees = mesh.degrees

    # 1. pipeline split
    parts, stage_ids, ties = [model], [0], list[StageTie]()
    if degrees.pp > 1:
        parts, stage_ids, ties = split_model(
            model,
            split_points=spec.split_points,
            pp_rank=mesh.rank(Axis.pp),
            pp=degrees.pp,
            virtual=scheme.pp_virtual_stages,
        )
    # 2-5. tensor parallel, context parallel, activation checkpointing, compile, FSDP
    for part in parts:
        _shard_part(part, mesh=mesh, scheme=scheme, spec=spec, device=device, decided=decided)

    # 6. materialize (with CPU offload, FSDP's shards on the host)
    if decided.use_fsdp and scheme.cpu_offload:
        from dtk.parallel.fsdp import materialize_offloaded

        materialize_offloaded(parts, materialize, device=device)
    else:
        materialize(parts, device)

    # 7. DDP (needs real weights: it checks and broadcasts them when it wraps)
    comm_states: list[Any] = []
    if decided.use_ddp:
        parts, comm_states = _wrap_ddp(parts, mesh=mesh, scheme=scheme, device=device)

    # 8. autocast (FSDP casts by its policy instead)
    autocast = decided.param_dtype if decided.param_dtype != torch.float32 and not decided.use_fsdp else None
    # 9. the pipeline schedule over this rank's stages
    pipeline = None
    if degrees.pp > 1:
        pipeline = _schedule(parts, stage_ids, ties, mesh=mesh, scheme=scheme, device=device, autocast=autocast,
                             loss_fn=loss_fn, num_microbatches=num_microbatches,
                             sharded_loss=decided.loss_parallel)
    return Parallelized(parts=parts, pipeline=pipeline, autocast_dtype=autocast,
                        loss_parallel=decided.loss_parallel, comm_states=comm_states)


def _decide(
    model: nn.Module,
    *,
    mesh: ParallelMesh,
    scheme: SchemeConfig,
    spec: ParallelSpec,
    device: torch.device,
    sharded_logits: bool,
    local_replicas: bool,
) -> _Decided:
    """Step 0: the dtypes, FSDP or DDP, the TP plan checked on the whole model, and whether
    logits stay sharded."""
    degrees = mesh.degrees
    param_dtype = resolve_dtype(scheme.param_dtype, device, auto=torch.bfloat16, key="scheme.param_dtype")
    reduce_dtype = resolve_dtype(scheme.reduce_dtype, device, auto=torch.float32, key="scheme.reduce_dtype")
    # The planner's decisions (dtk.plan.layout), so the budget lays out what runs here.
    use_fsdp, use_ddp = uses_fsdp(scheme, degrees), uses_ddp(scheme, degrees) and not local_replicas
    use_ddp = use_ddp and not zero1_reduces_gradients(scheme, degrees)  # ZeRO-1 with tp reduces them itself

    if degrees.tp > 1:
        from dtk.parallel.tp import check_tp_plan

        check_tp_plan(model, spec.tp_plan)
    # Sharded logits need a task whose loss computes on shards (`sharded_logits`); a
    # pipeline's last stage computes it on them too, inside the schedule.
    loss_parallel = degrees.tp > 1 and sharded_logits
    return _Decided(param_dtype=param_dtype, reduce_dtype=reduce_dtype, use_fsdp=use_fsdp, use_ddp=use_ddp,
                    loss_parallel=loss_parallel, local_replicas=local_replicas)


def _shard_part(
    part: nn.Module,
    *,
    mesh: ParallelMesh,
    scheme: SchemeConfig,
    spec: ParallelSpec,
    device: torch.device,
    decided: _Decided,
) -> None:
    """Steps 2-5 on one part (a stage, or the whole model), in place."""
    degrees = mesh.degrees
    # 2. tensor parallel
    if degrees.tp > 1:
        from dtk.parallel.tp import apply_tp

        tp_ties = tied_groups(part)  # each module's weight becomes its own DTensor: tie them again
        apply_tp(part, mesh=mesh[Axis.tp], tp_plan=spec.tp_plan, sequence_parallel=scheme.sequence_parallel,
                 loss_parallel=decided.loss_parallel)
        retie(part, tp_ties)
    # 2b. context parallel
    if degrees.cp > 1:
        from dtk.parallel.cp import CpLayout, apply_cp

        layout = CpLayout.of(mesh)
        assert layout is not None
        apply_cp(part, layout=layout)
    # 3. activation checkpointing
    if scheme.activation_checkpoint != ActivationCheckpoint.none:
        from dtk.parallel.ac import apply_ac

        apply_ac(part, mode=scheme.activation_checkpoint, wrap_classes=spec.wrap_classes)
    # 4. compile
    if scheme.compile:
        from dtk.parallel.compile import apply_compile

        apply_compile(part, wrap_classes=spec.wrap_classes, fullgraph=scheme.compile_fullgraph)
    # 4b. mixture of experts: routing counted over the step's ranks, experts over ep (dtk.parallel.ep)
    from dtk.parallel.ep import apply_ep

    apply_ep(part, mesh=mesh, param_dtype=decided.param_dtype, reduce_dtype=decided.reduce_dtype,
             reshard_after_forward=reshards_after_forward(scheme, degrees), local_replicas=decided.local_replicas)
    # 5. FSDP (on the meta device: shards are allocated by materialize)
    if decided.use_fsdp:
        from dtk.parallel.fsdp import apply_fsdp

        # 1-D when there is nothing to replicate: HSDP with one replica would only add
        # a no-op all-reduce per step.
        replicated = degrees.dp_replicate > 1 and not decided.local_replicas
        apply_fsdp(
            part,
            mesh=mesh.data_parallel_2d if replicated else mesh.fsdp_shard,
            wrap_classes=spec.wrap_classes,
            reshard_after_forward=reshards_after_forward(scheme, degrees),
            param_dtype=decided.param_dtype,
            reduce_dtype=decided.reduce_dtype,
            cpu_offload=scheme.cpu_offload,
            device=device,
        )


def _wrap_ddp(
    parts: list[nn.Module], *, mesh: ParallelMesh, scheme: SchemeConfig, device: torch.device
) -> tuple[list[nn.Module], list[Any]]:
    """Step 7: each part under DDP, with scheme.grad_compression's comm hook; the parts and
    the hooks' states."""
    from dtk.parallel.ddp import apply_ddp

    parts = [
        apply_ddp(part, device=device, bucket_cap_mb=scheme.bucket_cap_mb, process_group=mesh.dp_group)
        for part in parts
    ]
    from dtk.parallel.compression import apply_compression  # scheme.grad_compression: a comm hook

    states = [apply_compression(part, compression=scheme.grad_compression,  # type: ignore[arg-type]
                                powersgd_rank=scheme.powersgd_rank, group=mesh.dp_group) for part in parts]
    return parts, [s for s in states if s is not None]


def _schedule(
    parts: list[nn.Module],
    stage_ids: list[int],
    ties: list[StageTie],
    *,
    mesh: ParallelMesh,
    scheme: SchemeConfig,
    device: torch.device,
    autocast: torch.dtype | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_microbatches: int,
    sharded_loss: bool,
) -> Pipeline:
    """Step 9: the pipeline schedule over this rank's stages."""
    num_stages = mesh.degrees.pp * scheme.pp_virtual_stages
    if autocast is not None:  # each stage's forward under autocast, sending in the compute dtype
        from dtk.parallel.pipeline import autocast_stage

        for part, stage_id in zip(parts, stage_ids, strict=True):
            autocast_stage(part, device_type=device.type, dtype=autocast, sends=stage_id < num_stages - 1)
    pipeline = build_pipeline(
        parts,
        stage_ids,
        num_stages=num_stages,
        schedule=scheme.pp_schedule,
        num_microbatches=num_microbatches,
        loss_fn=loss_fn,
        device=device,
        group=mesh.pp_group,
        sharded_loss=sharded_loss,
    )
    if ties:  # a weight tied across stages (embedding and head): its copies' gradients summed
        from dtk.parallel.stage_ties import embedding_groups, grad_sync, mark_copies

        mark_copies(parts)
        pipeline.after_step(grad_sync(parts, ties, embedding_groups(mesh.world, ties)))
    return pipeline
