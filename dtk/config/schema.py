"""Configuration schemas: the single source of truth for every key, its type and default.

YAML files in ``conf/`` only choose and override. Each field carries a doc string right
under it; ``python -m dtk.plan --help`` prints them (see ``dtk.config.docs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from dtk.config.access import AccessConfig
from dtk.config.choices import (
    ActivationCheckpoint,
    Backend,
    ClusterKind,
    DataParallel,
    DeviceKind,
    Dtype,
    GradCompression,
    MatmulPrecision,
    OptimizerName,
    PipelineSchedule,
    TpStyle,
    Tracker,
)
from dtk.config.fabric import DoctorConfig, FabricConfig, PlanConfig  # part of this schema
from dtk.config.fields import IDENTITY  # marks what a run computes (its name's hash)
from dtk.config.sections import DATA_SCHEMAS as DATA_SCHEMAS  # the data and task sections, part of this schema
from dtk.config.sections import CheckpointConfig as CheckpointConfig  # part of this schema
from dtk.config.sections import EpKeys, Hdf5DataConfig, MoeKeys, SyntheticDataConfig, TaskConfig, UserDataConfig
from dtk.config.sync import SyncConfig as SyncConfig  # part of this schema


@dataclass
class ClusterConfig:
    kind: ClusterKind = ClusterKind.local
    """Where workers run: `local` (this machine, no Slurm) or `slurm` (sbatch through submitit)."""
    partition: str | None = None
    """Slurm partition (sbatch --partition). None: the cluster's default partition."""
    account: str | None = None
    """Slurm account to charge (sbatch --account)."""
    qos: str | None = None
    """Slurm quality of service (sbatch --qos)."""
    constraint: str | None = None
    """Slurm node features the job needs (sbatch --constraint), e.g. `a100&ib`."""
    gpus_per_node: int = 0
    """GPUs to request per node (sbatch --gpus-per-node). 0 on CPU clusters."""
    cpus_per_task: int = 1
    """CPU cores per worker process (sbatch and srun --cpus-per-task)."""
    gpu_bind: str | None = None
    """srun --gpu-bind of the worker step where a site needs its own, e.g. `closest` (each task sees its socket's GPUs; each worker takes the one at its position among them). None: srun --gpus-per-task=1 when every task has a GPU (each sees only its own), else no binding."""
    mem_gb: int | None = None
    """Memory per node in GiB (sbatch --mem). None: the partition's default."""
    time_min: int = 60
    """Wall-clock limit of one allocation in minutes (sbatch --time)."""
    exclusive: bool = False
    """Ask for whole nodes (sbatch --exclusive)."""
    sbatch_extra: list[str] = field(default_factory=list)
    """Extra sbatch flags, verbatim, e.g. `["--reservation=big"]`."""
    setup: list[str] = field(default_factory=list)
    """Names of files in slurm_templates/setup/ whose lines run before the workers (module loads, NCCL env)."""
    log_dir: str | None = None
    """Where submitit puts the job's stdout/stderr. None: `<run dir>/slurm`."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables set in every worker before the process group starts; NCCL_* / GLOO_* / MASTER_ADDR here win over what dtk detects (docs/topology.md)."""
    exclude_from: str | None = None
    """A file of node names to keep out of the job (sbatch --exclude), one per line, `#` comments: the list `python -m dtk.doctor` writes. None: none."""
    suspect_after: int = 2
    """A node that this many runs under the same run.root exclude (each after a failure on it) is suspect: left out of every new submission there (sbatch --exclude) until `python -m dtk.nodes RUN_ROOT --readmit NODE`; `python -m dtk.watch` alerts on it (docs/recovery.md). 0: never."""
    accelerator: str | None = None
    """The GPU model, for the memory budget, the step time and MFU: a row of dtk/plan/accelerators.py (`python -m dtk.plan` lists them on a wrong name). None: unknown."""
    device_memory_gb: float | None = None
    """Memory per device in decimal GB; overrides the accelerator's figure (a MIG slice, a new part). None: from cluster.accelerator, or on the CPU the node's memory over its workers."""
    peak_tflops: float | None = None
    """Dense peak TFLOP/s of one device in the dtype the matmuls run in, the denominator of MFU. None: the accelerator table's (dtk/plan/accelerators.py) for cluster.accelerator, else for the GPU's name; no MFU on the CPU."""
    intra_node_gbps: float | None = None
    """Bus bandwidth between the GPUs of a node in GB/s per device (NVLink / NVSwitch; what `python -m dtk.doctor` measured), for the planner's step time. None: the accelerator's figure (dtk/plan/accelerators.py)."""
    inter_node_gbps: float | None = None
    """Bus bandwidth across nodes in GB/s through one network card, what one rank per node reaches (InfiniBand / Ethernet; what `python -m dtk.doctor` measured across nodes), for the planner's step time. None: the accelerator's figure (dtk/plan/accelerators.py: a 400 Gb/s card for H100 and later, 200 Gb/s for A100)."""
    matmul_rates: str | None = None
    """What `python -m dtk.bench matmul --out DIR` measured on the nodes (the folder, or one matmul-HOST.json), for the planner's step time: the efficiency of a job's matmuls follows the slowest node's rate at their width (hidden / tp). None: the accelerator's one figure at every width."""
    nics_per_node: int = 1
    """Network cards of a node used for training traffic (rails), for the planner's step time: a collective whose group spans whole nodes uses all of them, a group with one rank per node one, and the node's groups share them. A DGX H100 or A100 has 8."""


@dataclass
class ModelParallelConfig:
    """What dtk reads of any model besides its factory: how to parallelize it (docs/schemes.md)."""

    wrap_classes: list[str] = field(default_factory=list)
    """Classes of the repeated blocks: units of FSDP sharding, activation checkpointing and compile."""
    tp_plan: dict[str, TpStyle] = field(default_factory=dict)
    """Tensor-parallel plan: module path pattern -> colwise, rowwise, colwise_output, sequence_parallel or sequence_gather."""
    split_points: list[str] = field(default_factory=list)
    """Module paths where pipeline stages 1, 2, ... begin. Empty: the blocks split evenly over the stages."""


@dataclass
class TransformerConfig(MoeKeys, ModelParallelConfig):
    """The built-in transformer's keys (group `model`, option `transformer`)."""

    _target_: str = field(default="dtk.models.transformer.build", metadata=IDENTITY)
    """Factory that returns the nn.Module; any importable callable taking these keys as keyword arguments."""
    vocab_size: int = field(default=256, metadata=IDENTITY)
    """Number of token ids."""
    dim: int = field(default=64, metadata=IDENTITY)
    """Hidden size."""
    num_layers: int = field(default=2, metadata=IDENTITY)
    """Number of transformer blocks."""
    num_heads: int = field(default=4, metadata=IDENTITY)
    """Attention heads; must divide dim."""
    ffn_hidden: int = field(default=0, metadata=IDENTITY)
    """Hidden size of the SwiGLU feed-forward. 0: 8/3 x dim rounded up to a multiple of 16."""
    seq_len: int = field(default=64, metadata=IDENTITY)
    """Tokens per sample (context length)."""
    norm_eps: float = field(default=1e-5, metadata=IDENTITY)
    """RMSNorm epsilon."""
    dropout: float = field(default=0.0, metadata=IDENTITY)
    """Dropout probability after attention and feed-forward (training only). 0: off."""
    tie_embeddings: bool = field(default=False, metadata=IDENTITY)
    """The output head's weight is the token embedding's: one (vocab_size, dim) parameter (GPT-2 style)."""


@dataclass
class HfModelConfig(ModelParallelConfig):
    """A Hugging Face causal language model by its config.json (group `model`, option `hf`;
    docs/byo.md). Local files only, no network; pip install "dtk-train[hf]"."""

    _target_: str = "dtk.models.hf.build"
    """Factory that builds the transformers model (dtk.models.hf.build)."""
    config: str | None = None
    """Folder holding the model's config.json: the architecture, with random weights."""
    init_from: str | None = None
    """Folder of config.json and safetensors weights (save_pretrained's, or dtk.checkpoint export --format hf)."""
    seq_len: int = 256
    """Tokens per sample: the data is cut to it; at most the model's max_position_embeddings (checked at submission)."""
    vocab_size: int | None = None
    """Token ids of the data, at most the model's vocabulary. null: with generated data, config.json's vocab_size."""
    attn_implementation: str = "sdpa"
    """transformers' attention implementation (sdpa, eager, flash_attention_2 where installed)."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """config.json keys to replace, e.g. {num_hidden_layers: 2}."""


@dataclass
class ModelConfig(ModelParallelConfig):
    """The `model` section after composition, the same for every model: the factory, how to
    parallelize it, and the factory's own keyword arguments. A user's model has no schema
    (its yaml is free-form), so its keys stay a dict; the built-in transformer's keys were
    checked against TransformerConfig while composing."""

    _target_: str = field(default=MISSING, metadata=IDENTITY)
    """Factory that returns the nn.Module (a dotted path)."""
    kwargs: dict[str, Any] = field(default_factory=dict, metadata=IDENTITY)
    """The factory's keyword arguments: every other key of the model's section."""

    @property
    def seq_len(self) -> int | None:
        """Tokens per sample, when the factory takes `seq_len` (the data is cut to it)."""
        return self.kwargs.get("seq_len")

    @property
    def vocab_size(self) -> int | None:
        """Token ids, when the factory takes `vocab_size` (the data must stay below it)."""
        return self.kwargs.get("vocab_size")


@dataclass
class OptimConfig:
    name: OptimizerName = field(default=OptimizerName.adamw, metadata=IDENTITY)
    """Optimizer; `adamw` (torch.optim.AdamW)."""
    lr: float = field(default=3e-3, metadata=IDENTITY)
    """Peak learning rate, reached at the end of warmup."""
    weight_decay: float = field(default=0.1, metadata=IDENTITY)
    """Decoupled weight decay (AdamW)."""
    beta1: float = field(default=0.9, metadata=IDENTITY)
    """AdamW beta1."""
    beta2: float = field(default=0.95, metadata=IDENTITY)
    """AdamW beta2."""
    eps: float = field(default=1e-8, metadata=IDENTITY)
    """AdamW epsilon."""
    warmup_steps: int = field(default=20, metadata=IDENTITY)
    """Linear warmup from 0 to `lr` over these optimizer steps."""
    min_lr_ratio: float = field(default=0.1, metadata=IDENTITY)
    """Cosine decay ends at `lr x min_lr_ratio` on the last step."""
    grad_clip: float = field(default=1.0, metadata=IDENTITY)
    """Clip the global gradient norm to this value; 0 disables clipping."""


@dataclass
class SchemeConfig(EpKeys):
    """Defaults are plain DDP, what a job without `+scheme=` runs. docs/schemes.md explains each scheme."""

    name: str = "ddp"
    """Parallelism scheme. Chosen with `+scheme=NAME`; without one a multi-worker job is DDP."""
    dp_replicate: int = -1
    """Data-parallel replicas (outermost mesh axis, across nodes); -1: inferred."""
    dp_shard: int = 1
    """Data-parallel shards (FSDP); -1: inferred so that the degrees multiply to the world size."""
    tp: int = 1
    """Tensor-parallel degree (innermost mesh axis, inside a node); -1: inferred."""
    pp: int = 1
    """Pipeline-parallel degree; -1: inferred."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over cp ranks (2 x cp chunks, rank i holds chunks i and 2 x cp - 1 - i), attention gathers the keys and values of the whole sequence; needs data_parallel=fsdp (parameters sharded over dp_shard x cp) and model.seq_len divisible by 2 x cp. -1: inferred."""
    data_parallel: DataParallel = DataParallel.ddp
    """How data-parallel ranks hold the model: `ddp` (DistributedDataParallel, replicated; needs dp_shard=1, tp=1) or `fsdp` (FSDP2 over dp_replicate x dp_shard)."""
    bucket_cap_mb: int = 25
    """DDP gradient bucket size in MiB."""
    shard_optimizer: bool = False
    """ZeRO-1: shard the optimizer state over the data-parallel ranks (with data_parallel=ddp)."""
    reshard_after_forward: bool | None = None
    """FSDP: `true` frees a unit's gathered parameters after its forward (ZeRO-3), `false` keeps them until its backward (ZeRO-2: one all-gather per micro-batch instead of two). None: true, except with pp > 1, where a stage's parameters stay gathered through the pipeline step (resharding would all-gather them again for every micro-batch)."""
    cpu_offload: bool = False
    """FSDP: keep parameter shards, gradients and optimizer state in host memory."""
    sequence_parallel: bool = False
    """With tp > 1: shard norms and residual activations along the sequence too."""
    pp_schedule: PipelineSchedule = PipelineSchedule("1f1b")
    """Pipeline schedule: `gpipe`, `1f1b` or `interleaved_1f1b` (needs pp_virtual_stages >= 2)."""
    pp_virtual_stages: int = 1
    """Pipeline stages per pipeline rank (interleaved 1F1B); the model is cut into pp x this many stages."""
    pp_microbatches: int = 0
    """Pipeline micro-batches per optimizer step. 0: global_batch / (micro_batch x data-parallel size), or 2 x pp x pp_virtual_stages when train.micro_batch is unset; set: train.micro_batch follows from it."""
    activation_checkpoint: ActivationCheckpoint = ActivationCheckpoint.none
    """Recompute activations in backward: `none`, `selective` (keep matmul and attention outputs) or `full` (each block)."""
    compile: bool = False
    """torch.compile each block."""
    compile_fullgraph: bool = True
    """With compile: each block must compile to one graph (fullgraph=True), so a graph break is an error at the first step that names it; false allows breaks and logs each once."""
    param_dtype: Dtype = Dtype.auto
    """Dtype of parameters in forward/backward: `auto` (bfloat16 on a GPU that supports it, else float32; float32 on CPU), `float32` or `bfloat16`. `float16` is refused: dtk has no gradient scaler."""
    reduce_dtype: Dtype = Dtype.auto
    """Dtype of the FSDP gradient reduction: `auto` (float32), `float32` or `bfloat16`."""
    matmul_precision: MatmulPrecision = MatmulPrecision.auto
    """float32 matmuls (torch.set_float32_matmul_precision): `auto` (`high` on a GPU: TF32 tensor cores; `highest` on CPU), `highest` (exact float32), `high` or `medium`."""
    grad_compression: GradCompression = field(default=GradCompression.none, metadata=IDENTITY)
    """DDP only: what the every-step gradient all-reduce sends, by torch's DDP communication hooks: `none`, `bf16` (half the bytes) or `powersgd` (low-rank, `powersgd_rank`, with error feedback kept in the checkpoint). docs/schemes.md."""
    powersgd_rank: int = field(default=2, metadata=IDENTITY)
    """With grad_compression=powersgd: the rank of the gradient approximation (>= 1); higher sends more, approximates better."""


@dataclass
class TrainConfig:
    steps: int = field(default=300, metadata=IDENTITY)
    """Optimizer steps to train for."""
    global_batch: int = field(default=128, metadata=IDENTITY)
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch: int | None = None
    """Samples per forward/backward on one worker; gradient accumulation makes up the rest. None: global_batch / data-parallel size (no accumulation)."""
    seed: int = field(default=0, metadata=IDENTITY)
    """Seed of model initialisation and data order."""
    log_every: int = 10
    """Every this many steps: a progress line, the metrics.jsonl records of the steps since the last (one per step, their loss and gradient norm read from the device in one transfer), and the gathering of every rank's phase times (straggler check)."""
    profile: bool = True
    """Time each step's phases (data, forward, backward, optimizer, comm, checkpoint, straggler) into metrics.jsonl; marks are read once per train.log_every steps. False: no phases, no idle_share, no straggler check."""
    system_every_s: float = 10.0
    """Seconds between host and GPU load samples (CPU, memory, disk and network; GPU utilisation, memory and power through NVML) in system.jsonl, one sampler thread per node. 0: none."""
    tracker: list[Tracker] = field(default_factory=list)
    """Experiment trackers rank 0 logs the metrics to, besides metrics.jsonl: any of `tensorboard` (event files in `<run dir>/tensorboard`), `mlflow`, `wandb`, e.g. `train.tracker=[mlflow,wandb]`. One tracker run per dtk run for its whole life, its id in `<run dir>/tracker.json`; an unreachable tracker never stops training (docs/operations.md, Trackers). A tracker whose package is not installed is an error at submit."""
    tensorboard: bool = False
    """Same as `tensorboard` in train.tracker (the older spelling, kept)."""
    mlflow_uri: str | None = None
    """MLflow tracking URI: `http://host:5000`, `sqlite:////shared/mlflow.db`, ... None: MLFLOW_TRACKING_URI of the workers' environment (a Slurm job inherits the submitting shell's), else MLflow's own default. The experiment: MLFLOW_EXPERIMENT_NAME, else `dtk`; W&B: WANDB_PROJECT (else `dtk`), WANDB_ENTITY, WANDB_MODE=offline."""
    threads: int = 0
    """torch intra-op threads per worker on CPU. 0: the machine's cores divided by the workers on it."""
    eval_every: int = 0
    """Validation loss every this many optimizer steps (and at the last step), logged to eval.jsonl. 0: never."""


@dataclass
class DistConfig:
    backend: Backend = Backend.auto
    """Process-group backend: `auto` (nccl with GPUs, gloo without), `nccl` or `gloo`."""
    timeout_s: int = 300
    """Collective timeout in seconds; a hung collective fails after this instead of at walltime."""
    device: DeviceKind = DeviceKind.auto
    """`auto` (cuda when available), `cuda` or `cpu`."""


@dataclass
class FaultConfig:
    max_restarts: int = 3
    """Relaunches after a crash or hang within one allocation before the job fails."""
    max_steps: int = 1000
    """Worker steps (srun) one Slurm job may start, over all its allocations (a requeue keeps the job id): the first start of each, relaunches after a crash or hang, starts after a lost node. The start beyond it fails the job with one line, and the same command goes on from the last checkpoint as a new job. Sites limit the steps of a job (slurm.conf MaxStepCount); keep it below theirs (docs/recovery.md)."""
    hang_timeout_s: int = 60
    """A start whose training thread shows no progress for this long is torn down and relaunched: no micro-batch, pipeline action, step or validation batch completed, outside a checkpoint save or load and the first step. Never shorter than twice the longest gap measured between two such ticks (docs/recovery.md, Liveness)."""
    startup_timeout_s: int = 300
    """Time a start may take to its first heartbeat (imports, process group, building the model); the checkpoint load after it is busy time, beaten through."""
    survive_node_loss: bool = True
    """Submit with --no-kill so that a failed node ends the worker step, not the job: the driver relaunches on the nodes left. False: Slurm requeues the whole job."""
    shrink: bool = True
    """After a node failure with no spare left, continue on fewer nodes (same global batch, more accumulation) when the scheme allows it."""
    straggler_factor: float = 1.5
    """A rank whose busy time per step (step time less waiting for others), over a train.log_every interval, exceeds the median rank's by this factor is flagged: a `straggler` event with its host. 0: never flagged."""
    signal_lead_floor_s: int = 60
    """Least lead time of the pre-time-limit signal; the lead grows with the measured checkpoint save and step time."""
    divergence: bool = True
    """Check every step's global loss and gradient norm before its update (docs/recovery.md, Divergence): a bad step's update is skipped. Costs one host read per step (on a GPU, one wait). False: no check, a NaN trains on."""
    spike_factor: float = 10.0
    """A step whose loss exceeds this factor x the median of the last `spike_window` good losses is bad, like a non-finite loss or gradient norm. 0: only non-finite values are bad."""
    spike_window: int = 50
    """Good steps in the running median of the spike check; a spike is judged only once the window is full (a resume or a rollback restores it as it stood at its checkpoint)."""
    rollback_after: int = 3
    """Bad steps within `rollback_window` steps that count as a divergence ("it repeats"): the run rolls back to the newest verified checkpoint before the first of them and skips the data window from the first to the last (RUN_DIR/data_skips.json). 0: skip bad updates, never roll back."""
    rollback_window: int = 20
    """Steps over which bad steps are counted for `rollback_after`."""
    max_rollbacks: int = 2
    """Rollbacks a run may make; the next divergence fails it with one line naming the bad steps and their batch hashes (the drivers do not relaunch it)."""


@dataclass
class RunConfig:
    root: str = "runs"
    """Folder that holds run directories; must be on storage every node sees."""
    name: str | None = None
    """Run directory name. None: `<model>-<hash of the identity keys that differ from their defaults>` (docs/recovery.md), so the same command continues the same run, also after an upgrade of dtk."""


@dataclass
class SubmitConfig:
    dry_run: bool = False
    """Print what would be launched and exit without creating anything."""
    wait: bool | None = None
    """Follow a Slurm job until it ends. None: no on Slurm; the local cluster always follows its workers."""
    after: str | None = None
    """Start only once this Slurm job (or these, joined by ':') completed successfully: sbatch --dependency=afterok:JOB. Slurm only."""
    force: bool = False
    """Submit even when the memory budget says the job does not fit on its devices."""


@dataclass
class Config:
    nodes: int = 1
    """Nodes to run on (must be 1 on the local cluster)."""
    spare_nodes: int = 0
    """Hot spare nodes allocated on top of `nodes` (Slurm); a failed node is replaced by a spare without requeueing."""
    tasks_per_node: int | None = None
    """Worker processes per node: one per GPU (more is refused: two workers would share a GPU); on a CPU machine, how many processes. None: cluster.gpus_per_node, on the local cluster the GPUs this machine shows, else 2."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where the job runs (group `cluster`)."""
    model: Any = MISSING
    """The model (group `model`); `_target_` names its factory. After compose(): a ModelConfig."""
    data: Any = MISSING
    """Training data (group `data`). After compose(): a SyntheticDataConfig, Hdf5DataConfig or UserDataConfig."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The loss and evaluation metrics (group `task`): `lm` (next-token cross-entropy), or a callable of the user's."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule (group `optim`)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint interval and retention (group `checkpoint`)."""
    scheme: SchemeConfig | None = None
    """Parallelism (group `scheme`, added with `+scheme=NAME`). None: DDP (after compose(), SchemeConfig())."""
    sync: SyncConfig | None = None
    """Synchronize the data-parallel replicas every `sync.every` steps (group `sync`, `+sync=local_sgd` or `+sync=diloco`). None: every step."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    dist: DistConfig = field(default_factory=DistConfig)
    """torch.distributed settings."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Recovery from crashes, hangs, node failure and time limits."""
    fabric: FabricConfig = field(default_factory=FabricConfig)
    """Network fabric: discovery at start and the check that NCCL uses InfiniBand where there is one (docs/topology.md)."""
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    """What `python -m dtk.doctor` measures and when it calls a node slow (docs/topology.md)."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run directory."""
    submit: SubmitConfig = field(default_factory=SubmitConfig)
    """Submission behaviour."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """What-if inputs of the memory budget (python -m dtk.plan); unset for a real model."""
    access: AccessConfig = field(default_factory=AccessConfig)
    """Who may submit, read and maintain runs (group `access`, `access=NAME`; docs/access.md). The default, `open`, checks nothing."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form values for user code; ignored by dtk."""


def register() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "access" in cs.repo:  # stored by an earlier call (the last group below): storing again costs
        return                # a third of a compose, and every compose() calls this
    cs.store(name="dtk_schema", node=Config)
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    cs.store(group="model", name="transformer_schema", node=TransformerConfig)
    cs.store(group="model", name="hf_schema", node=HfModelConfig)
    cs.store(group="data", name="synthetic_schema", node=SyntheticDataConfig)
    cs.store(group="data", name="hdf5_schema", node=Hdf5DataConfig)
    cs.store(group="data", name="user_schema", node=UserDataConfig)
    cs.store(group="task", name="task_schema", node=TaskConfig)
    cs.store(group="optim", name="optim_schema", node=OptimConfig)
    cs.store(group="checkpoint", name="checkpoint_schema", node=CheckpointConfig)
    cs.store(group="scheme", name="scheme_schema", node=SchemeConfig)
    cs.store(group="sync", name="sync_schema", node=SyncConfig)
    cs.store(group="access", name="access_schema", node=AccessConfig)
