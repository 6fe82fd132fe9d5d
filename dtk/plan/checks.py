"""Every check of a config before it is planned: one `check_<section>` per section of the
schema (dtk/config/schema.py's Config), called in the schema's order by `check_config`, the
one place. Each raises UserError with one line naming the key, its value and what would work.

The sections that depend on the mesh (the scheme, +sync, the task and the batch split) are
checked once the degrees are resolved, with the `Layout` the plan is made of. The scheme's
own rules are dtk.plan.degrees's (check_scheme); the memory a job needs is judged at
submission (dtk.plan.cost.gate), after the plan. No torch, and no budget on import: the workers
read plans without it (dtk.plan.sync is imported where +sync is checked)."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.config.choices import ClusterKind, DataKind, Dtype
from dtk.config.convert import builtin_transformer
from dtk.config.fabric import PlanConfig
from dtk.config.hf_json import HF_TARGET, check_hf_model
from dtk.config.schema import CheckpointConfig, Config, FaultConfig, ModelConfig, OptimConfig
from dtk.config.sync import check_fragments
from dtk.plan.cost.whatif import check_whatif, whatif_of
from dtk.plan.degrees import WHATIF_TARGET, Degrees, check_cp_task, check_scheme, micro_batch_size, resolve_degrees
from dtk.plan.parts import check_builtin_arguments


@dataclass(frozen=True)
class Layout:
    """The mesh and batch the checks derive: what the plan is made of."""

    world: int
    tasks_per_node: int
    degrees: Degrees
    micro_batch: int
    per_step: int
    """Samples of one micro-batch over the data-parallel ranks."""


def check_config(cfg: Config, *, tasks_per_node: int, gpus: int, gpus_from: str,
                 import_path: tuple[str | Path, ...] = ()) -> Layout:
    """Every section's checks, in the schema's order; the mesh and batch they derive."""
    check_job(cfg, tasks_per_node=tasks_per_node, gpus=gpus, gpus_from=gpus_from)
    check_cluster(cfg)
    check_model(cfg, import_path)
    check_data(cfg, import_path)
    check_optim(cfg.optim)
    check_checkpoint(cfg.checkpoint)
    check_train(cfg)
    check_dist(cfg)
    check_fault(cfg.fault)
    check_run(cfg)
    check_submit(cfg)
    check_plan(cfg.plan)
    layout = check_batch(cfg, world=cfg.nodes * tasks_per_node, tasks_per_node=tasks_per_node)
    check_task(cfg, layout.degrees)
    check_scheme_section(cfg, layout)
    check_sync_section(cfg, layout.degrees)
    return layout


def positive(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{key}={value}: expected a positive integer")


def check_job(cfg: Config, *, tasks_per_node: int, gpus: int, gpus_from: str) -> None:
    """The top-level keys: nodes, spare_nodes, tasks_per_node."""
    nodes, tpn, spares = cfg.nodes, tasks_per_node, cfg.spare_nodes
    positive("nodes", nodes)
    positive("tasks_per_node", tpn)
    if gpus and tpn > gpus:
        # Each worker takes GPU local_rank % count: two would share one, and NCCL fails.
        raise UserError(
            f"tasks_per_node={tpn} is more workers than GPUs on a node ({gpus_from}): two workers would share"
            f" a GPU, which NCCL refuses; use tasks_per_node={gpus} (one worker per GPU), or dist.device=cpu"
        )
    if spares < 0:
        raise UserError(f"spare_nodes={spares}: expected 0 or a positive count of extra nodes")
    if spares and cfg.cluster.kind == ClusterKind.local:
        raise UserError(f"spare_nodes={spares}: spare nodes need a Slurm cluster; the local cluster has one machine")
    if cfg.cluster.kind == ClusterKind.local and nodes != 1:
        raise UserError(
            f"nodes={nodes}: the local cluster is this one machine, so nodes must be 1 "
            f"(use tasks_per_node={nodes * tpn} for {nodes * tpn} workers here, or cluster=slurm / cluster=lab)"
        )


def check_cluster(cfg: Config) -> None:
    cluster = cfg.cluster
    positive("cluster.time_min", cluster.time_min)
    positive("cluster.cpus_per_task", cluster.cpus_per_task)
    if cluster.gpus_per_node < 0:
        raise UserError(f"cluster.gpus_per_node={cluster.gpus_per_node}: expected 0 (a CPU cluster) or more")
    if cluster.suspect_after < 0:
        raise UserError(f"cluster.suspect_after={cluster.suspect_after}: expected 0 (never leave a node out) or a"
                        " number of runs, like 2")
    if cluster.mem_gb is not None:
        positive("cluster.mem_gb", cluster.mem_gb)
    positive("cluster.nics_per_node", cluster.nics_per_node)
    for key in ("device_memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps"):  # the planner's figures
        value = getattr(cluster, key)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(f"cluster.{key}={value}: expected a positive number, or leave it unset")


def check_target(key: str, target: str, import_path: tuple[str | Path, ...] = ()) -> None:
    """A `_target_` whose module cannot be found is an error here, not in every worker after
    the queue. Found, not imported (importlib.util.find_spec): the login node imports no torch."""
    module, _, name = str(target).rpartition(".")
    if not module or not name.isidentifier():
        raise UserError(f"{key}={target}: expected MODULE.FUNCTION, like dtk.models.transformer.build")
    added = [str(p) for p in import_path if str(p) not in sys.path]
    sys.path[:0] = added
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package that is missing
        spec = None
    finally:
        del sys.path[: len(added)]
    if spec is None:
        raise UserError(f"{key}={target}: no module {module} on the Python path (the project folder and the"
                        " installed packages); check the spelling, or submit from the project folder")


def check_model(cfg: Config, import_path: tuple[str | Path, ...]) -> None:
    """The model's factory, the shape the data needs, and the built-in transformer's own
    numbers (a user model's factory checks its keys when it is built)."""
    model = cfg.model
    check_target("model._target_", model._target_, import_path)
    check_builtin_arguments(model)
    if model._target_ == HF_TARGET:
        check_hf_model(model.kwargs)
    if cfg.data.kind == DataKind.synthetic and (model.seq_len is None or model.vocab_size is None):
        raise UserError(
            f"model._target_={model._target_}: synthetic data needs model.seq_len and model.vocab_size"
            " (the factory receives them too); add both to the model's yaml"
        )
    transformer = builtin_transformer(model)
    if transformer is None:
        return
    for key in ("vocab_size", "dim", "num_layers", "num_heads", "seq_len"):
        positive(f"model.{key}", getattr(transformer, key))
    if not 0 <= transformer.dropout < 1:
        raise UserError(f"model.dropout={transformer.dropout}: expected a probability in [0, 1)")
    dim, heads = transformer.dim, transformer.num_heads
    if dim % heads:
        raise UserError(
            f"model.num_heads={heads} does not divide model.dim={dim} ({dim} / {heads} = {dim / heads:.2f});"
            f" try num_heads={math.gcd(dim, heads)}"
        )


def check_data(cfg: Config, import_path: tuple[str | Path, ...]) -> None:
    if cfg.data.kind == DataKind.user:
        check_target("data._target_", cfg.data._target_, import_path)


def check_optim(optim: OptimConfig) -> None:
    if optim.grad_clip < 0:
        raise UserError(f"optim.grad_clip={optim.grad_clip}: expected 0 (no clipping) or a positive norm")
    if not (optim.lr > 0 and math.isfinite(optim.lr)):
        raise UserError(f"optim.lr={optim.lr}: expected a positive learning rate")
    if optim.warmup_steps < 0:
        raise UserError(f"optim.warmup_steps={optim.warmup_steps}: expected 0 or more")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(optim, key) < 1:
            raise UserError(f"optim.{key}={getattr(optim, key)}: expected a value in [0, 1), like 0.9 or 0.95")
    if not optim.eps > 0:
        raise UserError(f"optim.eps={optim.eps}: expected a small positive number, like 1e-8")
    if optim.weight_decay < 0:
        raise UserError(f"optim.weight_decay={optim.weight_decay}: expected 0 (none) or more, like 0.1")
    if not 0 <= optim.min_lr_ratio <= 1:
        raise UserError(f"optim.min_lr_ratio={optim.min_lr_ratio}: expected a fraction of optim.lr in [0, 1]")


def check_checkpoint(ckpt: CheckpointConfig) -> None:
    if ckpt.every < 0:
        raise UserError(f"checkpoint.every={ckpt.every}: expected 0 (only at the end) or a positive step count")
    if ckpt.memory_every < 0:
        raise UserError(f"checkpoint.memory_every={ckpt.memory_every}: expected 0 (the in-memory tier off) or a positive"
                        " step count")
    if ckpt.every_minutes < 0:
        raise UserError(f"checkpoint.every_minutes={ckpt.every_minutes}: expected 0 (off) or more")
    positive("checkpoint.keep", ckpt.keep)
    positive("checkpoint.max_failures", ckpt.max_failures)


def check_train(cfg: Config) -> None:
    train = cfg.train
    for key in ("steps", "global_batch", "log_every"):
        positive(f"train.{key}", getattr(train, key))
    if train.threads < 0:
        raise UserError(f"train.threads={train.threads}: expected 0 (automatic) or a positive count")
    if train.micro_batch is not None and train.micro_batch < 1:
        raise UserError(f"train.micro_batch={train.micro_batch}: expected a positive count of samples, or leave it"
                        " unset (global_batch / data-parallel size, no accumulation)")
    if train.eval_every < 0:
        raise UserError(f"train.eval_every={train.eval_every}: expected 0 (no evaluation) or a step count")


def check_dist(cfg: Config) -> None:
    positive("dist.timeout_s", cfg.dist.timeout_s)


def check_fault(fault: FaultConfig) -> None:
    if fault.max_restarts < 0:
        raise UserError(f"fault.max_restarts={fault.max_restarts}: expected 0 or more")
    positive("fault.max_steps", fault.max_steps)
    for key in ("hang_timeout_s", "startup_timeout_s"):
        if getattr(fault, key) < 1:
            raise UserError(f"fault.{key}={getattr(fault, key)}: expected a positive number of seconds")
    positive("fault.signal_lead_floor_s", fault.signal_lead_floor_s)
    if fault.straggler_factor != 0 and not fault.straggler_factor > 1:
        raise UserError(f"fault.straggler_factor={fault.straggler_factor}: expected 0 (off) or a factor above 1,"
                        " like 1.5 (at or below 1 every rank would be a straggler)")
    if fault.spike_factor != 0 and not (fault.spike_factor > 1 and math.isfinite(fault.spike_factor)):
        raise UserError(f"fault.spike_factor={fault.spike_factor}: expected 0 (only non-finite losses are bad) or a"
                        " factor above 1, like 10 (at or below 1 a loss at the median would be a spike)")
    if fault.spike_window < 1:
        raise UserError(f"fault.spike_window={fault.spike_window}: expected a positive count of good steps, like 50")
    if fault.max_rollbacks < 0:
        raise UserError(f"fault.max_rollbacks={fault.max_rollbacks}: expected 0 (fail at the first divergence) or"
                        " more")


def check_run(cfg: Config) -> None:
    name = cfg.run.name
    if name is not None and ("/" in name or name in (".", "..")):
        raise UserError(f"run.name={name}: expected a plain folder name without '/'")


AFTER_RE = re.compile(r"^\d+(_\d+)?(:\d+(_\d+)?)*$")


def check_submit(cfg: Config) -> None:
    """`submit.after` names Slurm job ids, and only a Slurm job can wait for them."""
    after, cluster_kind = cfg.submit.after, cfg.cluster.kind
    if after is None:
        return
    if not AFTER_RE.match(str(after)):
        raise UserError(f"submit.after={after}: expected a Slurm job id, or several joined by ':' (submit.after=4711"
                        " or submit.after=4711:4712)")
    if cluster_kind != ClusterKind.slurm:
        raise UserError(f"submit.after={after}: only a Slurm job can wait for another (cluster.kind={cluster_kind});"
                        " use cluster=slurm or a site's cluster file")


PLAN_RANGES: dict[str, tuple[bool, str]] = {
    # key: (0 allowed, what would work); each key is a count or a size, finite and positive
    "params": (False, "a positive parameter count, like 7e9"),
    "layers": (False, "a positive count of blocks, like 32"),
    "hidden": (False, "a positive hidden size, like 4096"),
    "seq_len": (False, "a positive sequence length, like 4096"),
    "heads": (False, "a positive count of attention heads, like 32"),
    "vocab_size": (False, "a positive vocabulary size, like 32000"),
    "param_bytes": (False, "a positive byte count per parameter, like 2 (the ZeRO paper) or 4 (dtk's fp32)"),
    "grad_bytes": (False, "a positive byte count per gradient element, like 2 (the ZeRO paper) or 4 (dtk's fp32)"),
    "optimizer_bytes": (True, "0 (an optimizer without state) or more bytes per parameter, like 8 (AdamW) or 12"),
    "max_nodes": (False, "a node count from 1 to {most} (the most the search tries)"),
}


def check_plan(plan: PlanConfig) -> None:
    """The plan.* what-if keys against their ranges, before the budget computes with them: a
    negative byte count would make any model fit, an infinite count end in an overflow."""
    from dtk.plan.cost.budget import NODE_CANDIDATES

    if not plan.count_timeout_s > 0:
        raise UserError(f"plan.count_timeout_s={plan.count_timeout_s}: expected a positive number of seconds, like 60")
    for key, (zero_ok, want) in PLAN_RANGES.items():
        value = getattr(plan, key)
        if value is None:
            continue
        ok = math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
        if key == "max_nodes":
            ok = ok and value <= NODE_CANDIDATES[-1]
        if not ok:
            raise UserError(f"plan.{key}={value}: expected {want.format(most=NODE_CANDIDATES[-1])}, or leave it unset")
    if plan.doctor is not None:
        from dtk.plan.cost.steptime import doctor_links

        doctor_links(plan.doctor)  # a folder that is not the doctor's is an error on the CPU too


def check_batch(cfg: Config, *, world: int, tasks_per_node: int) -> Layout:
    """The scheme's degrees on this world, and train.global_batch split over them."""
    scheme = cfg.scheme
    assert scheme is not None, "compose() sets the scheme"
    degrees = resolve_degrees(scheme, world)
    global_batch = cfg.train.global_batch
    if global_batch % degrees.dp:
        raise UserError(
            f"train.global_batch={global_batch} does not split over the data-parallel size {degrees.dp}"
            f" ({global_batch} / {degrees.dp} = {global_batch / degrees.dp:.2f});"
            f" try train.global_batch={degrees.dp * max(1, round(global_batch / degrees.dp))}"
        )
    micro = micro_batch_size(scheme, micro_batch=cfg.train.micro_batch, global_batch=global_batch, degrees=degrees)
    positive("train.micro_batch", micro)
    per_step = micro * degrees.dp
    if global_batch % per_step:
        raise UserError(
            f"train.global_batch={global_batch} is not a multiple of train.micro_batch x data-parallel size"
            f" = {micro} x {degrees.dp} = {per_step}; try train.global_batch={per_step * max(1, round(global_batch / per_step))}"
            f" or a train.micro_batch that divides {global_batch // degrees.dp if global_batch % degrees.dp == 0 else global_batch}"
        )
    return Layout(world=world, tasks_per_node=tasks_per_node, degrees=degrees, micro_batch=micro, per_step=per_step)


def check_task(cfg: Config, degrees: Degrees) -> None:
    check_cp_task(degrees, cfg.task._target_)
    if degrees.pp > 1 and cfg.task._target_ is not None:
        raise UserError(
            f"scheme.pp={degrees.pp} with task._target_={cfg.task._target_}: a pipeline runs the token-LM task only"
            " (token ids in, next-token cross-entropy on the last stage); use task=lm, or scheme.pp=1 (ddp, fsdp, tp)"
        )


def check_scheme_section(cfg: Config, layout: Layout) -> None:
    """The scheme on its degrees (dtk.plan.degrees.check_scheme), against a what-if model by its
    own dimensions; a pipeline of a Hugging Face model; float16."""
    scheme, degrees = cfg.scheme, layout.degrees
    assert scheme is not None, "compose() sets the scheme"
    from dtk.plan.sync import check_compression  # the budget's modules: off the workers' import path

    whatif = whatif_of(cfg)  # a what-if model is checked by its own dimensions, not the config's model
    checked_model = ModelConfig(_target_=WHATIF_TARGET) if whatif else cfg.model
    check_scheme(scheme, degrees, checked_model, num_microbatches=cfg.train.global_batch // layout.per_step,
                 eval_every=cfg.train.eval_every)
    check_compression(scheme, degrees)
    if whatif:
        check_whatif(degrees, whatif, virtual_stages=scheme.pp_virtual_stages)
    if degrees.pp > 1 and cfg.model._target_ == HF_TARGET:
        raise UserError(
            f"scheme.pp={degrees.pp} with model=hf: a Hugging Face model's forward does not skip the layers a"
            " pipeline stage does not hold; use scheme.pp=1 (ddp, fsdp, tp, hsdp)"
        )
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(scheme, key) == Dtype.float16:
            # float16 gradients underflow without loss scaling, and a scaler that works
            # across FSDP shards and pipeline stages is not part of dtk.
            raise UserError(f"scheme.{key}=float16: dtk has no gradient scaler, and float16 gradients underflow"
                            f" without one; use scheme.{key}=bfloat16 (as fast on A100 and newer GPUs) or float32")


def check_sync_section(cfg: Config, degrees: Degrees) -> None:
    """+sync on the scheme's degrees (dtk.plan.sync) and its fragments (dtk.config.sync)."""
    from dtk.plan.sync import check_sync

    assert cfg.scheme is not None, "compose() sets the scheme"
    check_sync(cfg.sync, cfg.scheme, degrees, memory_every=cfg.checkpoint.memory_every)
    check_fragments(cfg.sync)
