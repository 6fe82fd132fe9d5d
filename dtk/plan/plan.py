"""validate + plan: a frozen, printable plan from a typed config. Pure: no torch, no I/O but the
one read of run identity (an existing run directory's plan.json, dtk/plan/identity.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtk.config.choices import ClusterKind, DataKind, DeviceKind, Dtype
from dtk.config.convert import builtin_transformer, from_dict, to_dict
from dtk.config.fabric import PlanConfig
from dtk.config.hf_json import HF_TARGET, check_hf_model
from dtk.config.schema import Config, ModelConfig, SchemeConfig
from dtk.config.sync import check_fragments
from dtk.errors import UserError
from dtk.plan.degrees import WHATIF_TARGET, Degrees, check_cp_task, check_scheme, micro_batch_size, resolve_degrees
from dtk.plan.identity import run_identity
from dtk.plan.parts import check_builtin_arguments
from dtk.plan.whatif import check_whatif, whatif_of
from dtk.rundir import RunDir

DEFAULT_CPU_TASKS = 2  # workers per node when neither tasks_per_node nor GPUs say otherwise



@dataclass(frozen=True)
class Plan:
    """Everything a launch needs, derived once on the submitting machine. plan.json holds
    it; workers and drivers read it back typed (`from_json`)."""

    config: Config
    run_name: str
    run_dir: str
    config_hash: str
    cluster_kind: ClusterKind
    nodes: int
    tasks_per_node: int
    world_size: int
    scheme: str
    degrees: Degrees
    global_batch: int
    micro_batch: int
    grad_accum: int
    steps: int
    spare_nodes: int
    import_path: tuple[str, ...] = ()
    """The user's project folders: workers put them first on their import path (see SearchPath)."""
    memory: dict[str, Any] | None = None
    """Every rank's planned bytes (dtk.plan.planned_memory), added at submission by
    dtk.plan.gate.planned_memory; the workers hold their measurement against them. None: a
    plan not made by a submission (the driver's plan for other nodes, a test's)."""

    def to_json(self) -> str:
        raw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        raw["config"] = to_dict(self.config)
        raw["degrees"] = dataclasses.asdict(self.degrees)
        return json.dumps(raw, indent=2, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Plan:
        raw = json.loads(text)
        raw["config"] = from_dict(raw["config"])
        raw["degrees"] = Degrees(**raw["degrees"])
        raw["import_path"] = tuple(raw.get("import_path", ()))
        raw["cluster_kind"] = ClusterKind(raw["cluster_kind"])
        return Plan(**raw)

    @staticmethod
    def read(run: RunDir) -> Plan:
        """A run directory's plan, refused as the user's mistake unless it is dtk's and of
        this version's form."""
        run.read_plan()
        try:
            return Plan.from_json(run.plan_json.read_text())
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"RUN_DIR={run.path}: its plan.json is not a plan this dtk reads ({type(exc).__name__}:"
                            f" {exc}); was it written by another version?") from None

    def describe(self) -> str:
        from dtk.plan.sync import describe_sync

        d, ckpt = self.degrees, self.config.checkpoint
        lines = [
            f"run         {self.run_dir}",
            f"cluster     {self.cluster_kind}: {self.nodes} node(s) x {self.tasks_per_node} worker(s) = world {self.world_size}",
            f"scheme      {self.scheme}: {d.describe()}",
            f"sync        {describe_sync(self.config.sync, self.config.scheme or SchemeConfig())}",
            f"batch       global {self.global_batch} = micro {self.micro_batch} x accumulation {self.grad_accum}"
            f" x data-parallel {d.dp}",
            f"train       {self.steps} steps, checkpoint every {ckpt.every}, keep {ckpt.keep}",
        ]
        return "\n".join(lines)


AFTER_RE = re.compile(r"^\d+(_\d+)?(:\d+(_\d+)?)*$")


def check_after(after: str | None, cluster_kind: str) -> None:
    """`submit.after` names Slurm job ids, and only a Slurm job can wait for them."""
    if after is None:
        return
    if not AFTER_RE.match(str(after)):
        raise UserError(f"submit.after={after}: expected a Slurm job id, or several joined by ':' (submit.after=4711"
                        " or submit.after=4711:4712)")
    if cluster_kind != ClusterKind.slurm:
        raise UserError(f"submit.after={after}: only a Slurm job can wait for another (cluster.kind={cluster_kind});"
                        " use cluster=slurm or a site's cluster file")


def gpus_per_node(cfg: Config, local_gpus: int) -> tuple[int, str]:
    """GPUs a node gives the workers, and what says so: cluster.gpus_per_node, or on the
    local cluster the GPUs this machine shows (0 with dist.device=cpu: no GPU is used)."""
    if cfg.dist.device == DeviceKind.cpu:
        return 0, "dist.device=cpu"
    if cfg.cluster.gpus_per_node:
        return cfg.cluster.gpus_per_node, f"cluster.gpus_per_node={cfg.cluster.gpus_per_node}"
    if cfg.cluster.kind == ClusterKind.local and local_gpus:
        return local_gpus, f"this machine shows {local_gpus} GPUs"
    return 0, "no GPUs"


def make_plan(
    cfg: Config, *, cwd: str | Path | None = None, import_path: tuple[str | Path, ...] = (), local_gpus: int = 0
) -> Plan:
    """Validate the config and derive the plan. Raises UserError with the arithmetic.
    `local_gpus`: the GPUs this machine shows (dtk.plan.inputs.visible_gpus), which the
    local cluster starts one worker per by default."""
    cluster, train, fault, ckpt, optim = cfg.cluster, cfg.train, cfg.fault, cfg.checkpoint, cfg.optim
    nodes, tpn = cfg.nodes, cfg.tasks_per_node
    gpus, gpus_from = gpus_per_node(cfg, local_gpus)
    if tpn is None:
        tpn = gpus or DEFAULT_CPU_TASKS
    _positive("nodes", nodes)
    _positive("tasks_per_node", tpn)
    if gpus and tpn > gpus:
        # Each worker takes GPU local_rank % count: two would share one, and NCCL fails.
        raise UserError(
            f"tasks_per_node={tpn} is more workers than GPUs on a node ({gpus_from}): two workers would share"
            f" a GPU, which NCCL refuses; use tasks_per_node={gpus} (one worker per GPU), or dist.device=cpu"
        )
    spares = cfg.spare_nodes
    if spares < 0:
        raise UserError(f"spare_nodes={spares}: expected 0 or a positive count of extra nodes")
    if spares and cluster.kind == ClusterKind.local:
        raise UserError(f"spare_nodes={spares}: spare nodes need a Slurm cluster; the local cluster has one machine")
    if fault.max_restarts < 0:
        raise UserError(f"fault.max_restarts={fault.max_restarts}: expected 0 or more")
    _positive("fault.max_steps", fault.max_steps)
    for key in ("hang_timeout_s", "startup_timeout_s"):
        if getattr(fault, key) < 1:
            raise UserError(f"fault.{key}={getattr(fault, key)}: expected a positive number of seconds")
    check_after(cfg.submit.after, cluster.kind)
    if cluster.kind == ClusterKind.local and nodes != 1:
        raise UserError(
            f"nodes={nodes}: the local cluster is this one machine, so nodes must be 1 "
            f"(use tasks_per_node={nodes * tpn} for {nodes * tpn} workers here, or cluster=slurm / cluster=lab)"
        )
    for key in ("steps", "global_batch", "log_every"):
        _positive(f"train.{key}", getattr(train, key))
    if train.threads < 0:
        raise UserError(f"train.threads={train.threads}: expected 0 (automatic) or a positive count")
    if ckpt.every < 0:
        raise UserError(f"checkpoint.every={ckpt.every}: expected 0 (only at the end) or a positive step count")
    if ckpt.memory_every < 0:
        raise UserError(f"checkpoint.memory_every={ckpt.memory_every}: expected 0 (the in-memory tier off) or a positive"
                        " step count")
    if ckpt.every_minutes < 0:
        raise UserError(f"checkpoint.every_minutes={ckpt.every_minutes}: expected 0 (off) or more")
    _positive("checkpoint.keep", ckpt.keep)
    if train.micro_batch is not None and train.micro_batch < 1:
        raise UserError(f"train.micro_batch={train.micro_batch}: expected a positive count of samples, or leave it"
                        " unset (global_batch / data-parallel size, no accumulation)")
    if optim.grad_clip < 0:
        raise UserError(f"optim.grad_clip={optim.grad_clip}: expected 0 (no clipping) or a positive norm")
    _positive("checkpoint.max_failures", ckpt.max_failures)
    if not optim.lr > 0:
        raise UserError(f"optim.lr={optim.lr}: expected a positive learning rate")
    if optim.warmup_steps < 0:
        raise UserError(f"optim.warmup_steps={optim.warmup_steps}: expected 0 or more")
    _positive("dist.timeout_s", cfg.dist.timeout_s)
    _check_ranges(cfg)
    _check_model(cfg, import_path)

    world = nodes * tpn
    scheme = cfg.scheme
    assert scheme is not None, "compose() sets the scheme"
    degrees = resolve_degrees(scheme, world)
    global_batch = train.global_batch
    if global_batch % degrees.dp:
        raise UserError(
            f"train.global_batch={global_batch} does not split over the data-parallel size {degrees.dp}"
            f" ({global_batch} / {degrees.dp} = {global_batch / degrees.dp:.2f});"
            f" try train.global_batch={degrees.dp * max(1, round(global_batch / degrees.dp))}"
        )
    micro = micro_batch_size(scheme, micro_batch=train.micro_batch, global_batch=global_batch, degrees=degrees)
    _positive("train.micro_batch", micro)
    per_step = micro * degrees.dp
    if global_batch % per_step:
        raise UserError(
            f"train.global_batch={global_batch} is not a multiple of train.micro_batch x data-parallel size"
            f" = {micro} x {degrees.dp} = {per_step}; try train.global_batch={per_step * max(1, round(global_batch / per_step))}"
            f" or a train.micro_batch that divides {global_batch // degrees.dp if global_batch % degrees.dp == 0 else global_batch}"
        )
    from dtk.plan.sync import check_compression, check_sync  # the budget's modules: off the workers' import path

    whatif = whatif_of(cfg)  # a what-if model is checked by its own dimensions, not the config's model
    checked_model = ModelConfig(_target_=WHATIF_TARGET) if whatif else cfg.model
    check_scheme(scheme, degrees, checked_model, num_microbatches=global_batch // per_step, eval_every=train.eval_every)
    check_compression(scheme, degrees)
    check_sync(cfg.sync, scheme, degrees, memory_every=ckpt.memory_every)
    check_fragments(cfg.sync)
    if whatif:
        check_whatif(degrees, whatif, virtual_stages=scheme.pp_virtual_stages)
    if degrees.pp > 1 and cfg.model._target_ == HF_TARGET:
        raise UserError(
            f"scheme.pp={degrees.pp} with model=hf: a Hugging Face model's forward does not skip the layers a"
            " pipeline stage does not hold; use scheme.pp=1 (ddp, fsdp, tp, hsdp)"
        )
    check_cp_task(degrees, cfg.task._target_)
    if degrees.pp > 1 and cfg.task._target_ is not None:
        raise UserError(
            f"scheme.pp={degrees.pp} with task._target_={cfg.task._target_}: a pipeline runs the token-LM task only"
            " (token ids in, next-token cross-entropy on the last stage); use task=lm, or scheme.pp=1 (ddp, fsdp, tp)"
        )
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(scheme, key) == Dtype.float16:
            # float16 gradients underflow without loss scaling, and a scaler that works
            # across FSDP shards and pipeline stages is not part of dtk.
            raise UserError(f"scheme.{key}=float16: dtk has no gradient scaler, and float16 gradients underflow"
                            f" without one; use scheme.{key}=bfloat16 (as fast on A100 and newer GPUs) or float32")
    name = cfg.run.name
    if name is not None and ("/" in name or name in (".", "..")):
        raise UserError(f"run.name={name}: expected a plain folder name without '/'")
    root = Path(cfg.run.root).expanduser()
    if not root.is_absolute():
        root = Path(cwd or Path.cwd()) / root
    # The identity keys name the run; a run directory an earlier release named keeps its name.
    name, digest = run_identity(cfg, root)
    return Plan(
        config=cfg,
        run_name=name,
        run_dir=str(root / name),
        config_hash=digest,
        cluster_kind=cluster.kind,
        nodes=nodes,
        spare_nodes=spares,
        tasks_per_node=tpn,
        world_size=world,
        scheme=scheme.name,
        degrees=degrees,
        global_batch=global_batch,
        micro_batch=micro,
        grad_accum=global_batch // per_step,
        steps=train.steps,
        import_path=tuple(str(p) for p in import_path),
    )


def _check_ranges(cfg: Config) -> None:
    """Values the workers or Slurm would take and fail on (or train nonsense with) after the
    queue: each one against its range."""
    optim, cluster, fault = cfg.optim, cfg.cluster, cfg.fault
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(optim, key) < 1:
            raise UserError(f"optim.{key}={getattr(optim, key)}: expected a value in [0, 1), like 0.9 or 0.95")
    if not optim.eps > 0:
        raise UserError(f"optim.eps={optim.eps}: expected a small positive number, like 1e-8")
    if optim.weight_decay < 0:
        raise UserError(f"optim.weight_decay={optim.weight_decay}: expected 0 (none) or more, like 0.1")
    if not 0 <= optim.min_lr_ratio <= 1:
        raise UserError(f"optim.min_lr_ratio={optim.min_lr_ratio}: expected a fraction of optim.lr in [0, 1]")
    _positive("cluster.time_min", cluster.time_min)
    _positive("cluster.cpus_per_task", cluster.cpus_per_task)
    _positive("fault.signal_lead_floor_s", fault.signal_lead_floor_s)
    if not cfg.plan.count_timeout_s > 0:
        raise UserError(f"plan.count_timeout_s={cfg.plan.count_timeout_s}: expected a positive number of seconds, like 60")
    if cluster.gpus_per_node < 0:
        raise UserError(f"cluster.gpus_per_node={cluster.gpus_per_node}: expected 0 (a CPU cluster) or more")
    if cluster.suspect_after < 0:
        raise UserError(f"cluster.suspect_after={cluster.suspect_after}: expected 0 (never leave a node out) or a"
                        " number of runs, like 2")
    if cluster.mem_gb is not None:
        _positive("cluster.mem_gb", cluster.mem_gb)
    _positive("cluster.nics_per_node", cluster.nics_per_node)
    for key in ("device_memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps"):  # the planner's figures
        value = getattr(cluster, key)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(f"cluster.{key}={value}: expected a positive number, or leave it unset")
    if fault.straggler_factor != 0 and not fault.straggler_factor > 1:
        raise UserError(f"fault.straggler_factor={fault.straggler_factor}: expected 0 (off) or a factor above 1,"
                        " like 1.5 (at or below 1 every rank would be a straggler)")
    if cfg.train.eval_every < 0:
        raise UserError(f"train.eval_every={cfg.train.eval_every}: expected 0 (no evaluation) or a step count")
    check_plan_keys(cfg.plan)


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


def check_plan_keys(plan: PlanConfig) -> None:
    """The plan.* what-if keys against their ranges, before the budget computes with them: a
    negative byte count would make any model fit, an infinite count end in an overflow."""
    from dtk.plan.budget import NODE_CANDIDATES

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
        from dtk.plan.steptime import doctor_links

        doctor_links(plan.doctor)  # a folder that is not the doctor's is an error on the CPU too


def _positive(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{key}={value}: expected a positive integer")


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


def check_eval_split(num_val: int, *, every: int, max_samples: int, global_batch: int) -> int:
    """Validation samples one evaluation uses (whole global batches); with train.eval_every
    set, fewer than one batch is an error (the plan checks it for datasets it can size, the
    evaluator for the rest)."""
    usable = num_val if max_samples <= 0 else min(num_val, max_samples)
    num_samples = usable // global_batch * global_batch
    if every > 0 and num_samples == 0:
        raise UserError(
            f"train.eval_every={every}: the validation split has {num_val} samples (evaluating at most"
            f" {usable}), fewer than one global batch of {global_batch}; hold out more"
            " (data.val_fraction, data.val_shards, data.eval_samples) or set train.eval_every=0"
        )
    return num_samples


def _check_model(cfg: Config, import_path: tuple[str | Path, ...]) -> None:
    """The shape the data needs, and the built-in transformer's own numbers (a user model's
    factory checks its keys when it is built)."""
    model = cfg.model
    check_target("model._target_", model._target_, import_path)
    check_builtin_arguments(model)
    if cfg.data.kind == DataKind.user:
        check_target("data._target_", cfg.data._target_, import_path)
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
        _positive(f"model.{key}", getattr(transformer, key))
    if not 0 <= transformer.dropout < 1:
        raise UserError(f"model.dropout={transformer.dropout}: expected a probability in [0, 1)")
    dim, heads = transformer.dim, transformer.num_heads
    if dim % heads:
        raise UserError(
            f"model.num_heads={heads} does not divide model.dim={dim} ({dim} / {heads} = {dim / heads:.2f});"
            f" try num_heads={math.gcd(dim, heads)}"
        )
