"""The schemas of the `data`, `task` and `checkpoint` sections: what a step reads and computes, and
how it is kept (part of dtk/config/schema.py, which imports them; kept here to keep each module short)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from dtk.config.choices import AsyncMode, DataKind, TaskForm
from dtk.config.fields import IDENTITY


@dataclass
class SyntheticDataConfig:
    kind: DataKind = field(default=DataKind.synthetic, metadata=IDENTITY)
    """Data source: `synthetic` (generated Markov-chain tokens, learnable, no files)."""
    num_samples: int = field(default=8192, metadata=IDENTITY)
    """Samples in one epoch."""
    seed: int = field(default=1234, metadata=IDENTITY)
    """Seed of the generated token table (independent of train.seed)."""
    branching: int = field(default=4, metadata=IDENTITY)
    """Likely successors per token; lower means an easier, lower-entropy language."""
    eval_samples: int = 0
    """Validation samples per evaluation (rounded down to whole global batches). 0: all of the validation split."""


@dataclass
class Hdf5DataConfig:
    kind: DataKind = field(default=DataKind.hdf5, metadata=IDENTITY)
    """Data source: `hdf5` (a dataset folder made by `python -m dtk.data prepare`)."""
    path: str = field(default=MISSING, metadata=IDENTITY)
    """The dataset folder (manifest.json + HDF5 shards); must be on storage every node sees."""
    val_fraction: float = field(default=0.05, metadata=IDENTITY)
    """Share of the samples held out for validation, drawn with `split_seed`. Ignored when `val_shards` is set or the dataset has a prepared split (`prepare --val-fraction`)."""
    split_seed: int = field(default=0, metadata=IDENTITY)
    """Seed of the train / validation split (independent of train.seed)."""
    val_shards: list[str] = field(default_factory=list, metadata=IDENTITY)
    """Shard files (names in the manifest) that form the validation split, instead of a fraction. Empty: the validation shards `prepare --val-fraction` wrote (`val_00000.h5` ..., the manifest's `val_shards`), if any."""
    eval_samples: int = 1024
    """Validation samples per evaluation (the first of the split, rounded down to whole global batches). 0: all."""
    verify: bool = False
    """Check every shard's checksum when a job opens the dataset (sizes are always checked)."""


@dataclass
class UserDataConfig:
    """A dataset of the user's own (dtk/data/user.py, docs/byo.md). In a yaml of the user's,
    every key not declared here is a keyword argument of `_target_`."""

    kind: DataKind = field(default=DataKind.user, metadata=IDENTITY)
    """Data source: `user` (the map-style dataset a function of the user's returns)."""
    _target_: str = field(default=MISSING, metadata=IDENTITY)
    """Function returning a map-style dataset (`__len__`, `__getitem__` -> tensor, array, number, tuple or dict of them), or a (train, validation) pair, or a dict with `train` and `validation`."""
    kwargs: dict[str, Any] = field(default_factory=dict, metadata=IDENTITY)
    """The function's keyword arguments: every other key of the data section."""
    val_fraction: float = field(default=0.1, metadata=IDENTITY)
    """Share of the samples held out for validation, drawn with `split_seed`; ignored when the function returns both sets."""
    split_seed: int = field(default=0, metadata=IDENTITY)
    """Seed of the train / validation split (independent of train.seed)."""
    version: str | None = field(default=None, metadata=IDENTITY)
    """The dataset's version, checked on resume. None: the dataset's `version` attribute, else a hash of its length and a sample of its items."""
    eval_samples: int = 0
    """Validation samples per evaluation (rounded down to whole global batches). 0: all of the validation split."""


@dataclass
class TaskConfig:
    """What a step computes from a batch (dtk/train/task.py, docs/byo.md). The default,
    `task=lm`, is next-token cross-entropy on token ids."""

    _target_: str | None = field(default=None, metadata=IDENTITY)
    """The loss: a callable `(outputs, batch) -> loss` (task.form=outputs) or `(model, batch) -> loss` (task.form=model), returning the mean over the micro-batch's samples. None: next-token cross-entropy (task=lm)."""
    form: TaskForm = field(default=TaskForm.outputs, metadata=IDENTITY)
    """`outputs`: dtk runs the model on the batch's inputs (task.inputs) and hands the callable its outputs; `model`: the callable runs the model itself."""
    inputs: str | None = field(default=None, metadata=IDENTITY)
    """With form=outputs, what the model's forward takes: an index of a tuple batch or a key of a dict batch. None: a tensor batch whole, element 0 of a tuple, a dict whole."""
    metrics: dict[str, str] = field(default_factory=dict)
    """Evaluation metrics: name -> callable of the same form as the loss, returning the mean over the micro-batch (logged to eval.jsonl as val_NAME)."""


# The schema of each data kind: `data.kind` names it.
DATA_SCHEMAS: dict[DataKind, type] = {
    DataKind.synthetic: SyntheticDataConfig,
    DataKind.hdf5: Hdf5DataConfig,
    DataKind.user: UserDataConfig,
}


@dataclass
class CheckpointConfig:
    every: int = 50
    """Save every this many optimizer steps (and always at the last step). 0: only at the end."""
    keep: int = 2
    """Keep the newest this many complete checkpoints; older ones are deleted."""
    resume: bool = True
    """Resume from the newest checkpoint of the run directory that verifies (manifest and checksums); stop if some exist and none does. false: start over, refused where the run already holds committed checkpoints (use another run.name); restarts of the same submission still resume its own."""
    every_minutes: float = 0.0
    """Also save when this many minutes passed since the last save (ranks agree on the step). 0: off."""
    async_save: bool = True
    """Stage to CPU memory and write in the background while training continues; the next save waits for it."""
    async_mode: AsyncMode = AsyncMode.thread
    """Who writes an async save: `thread` (a thread of the training process; files checksummed while written) or `process` (DCP's checkpoint process per rank, off the training process's GIL; rank 0 reads the files back for the manifest's CRCs)."""
    memory_every: int = 0
    """In-memory snapshot tier: every this many optimizer steps each rank copies its own state to its node's /dev/shm and a replica to a rank on the next node (off the training thread after a copy); a relaunch after a crash, hang or node loss (on a spare, or on fewer nodes: resharded) restores from it when it is not older than the disk checkpoint (`tier` memory or peer in `checkpoint_loaded`), else from disk. 0: off (costs nothing). Host memory: own shard + replica, two steps kept. Measured on the built-in model (2 CPU threads): about 3 ms of the training thread per snapshot, so every 20 steps of 27 ms blocks 0.6% (benchmarks/memory_tier.py, docs/benchmarks.md)."""
    dir: str = ""
    """Where the checkpoints go. Empty: the run directory's checkpoints/ folder. `s3://BUCKET/PREFIX`: an S3 (or S3-compatible) object store, under PREFIX/RUN_DIR_NAME/ (needs s3fs: pip install "dtk-train[s3]"; endpoint and credentials from the standard AWS variables and files, AWS_ENDPOINT_URL_S3 for another server). Not part of the run's identity."""
    max_failures: int = 3
    """The run stops with an error line once this many saves in a row failed (no space, an I/O error, a read-only mount); before that training goes on, each failure is a `checkpoint_failed` event and the next interval tries again."""


@dataclass
class MoeKeys:
    """The built-in transformer's mixture-of-experts keys (model=moe, dtk/models/moe.py): part
    of TransformerConfig."""

    num_experts: int = field(default=0, metadata=IDENTITY)
    """Mixture of experts (model=moe): routed SwiGLU experts per block instead of the one feed-forward. 0: dense."""
    top_k: int = field(default=2, metadata=IDENTITY)
    """Experts each token is routed to (their softmax weights renormalized over the k); at most num_experts."""
    aux_loss_weight: float = field(default=0.01, metadata=IDENTITY)
    """Weight of the load-balancing loss (Switch/GShard: num_experts x sum of routed share x mean router probability, routed shares counted over the whole step's batch). 0: off."""
    capacity_factor: float = field(default=0.0, metadata=IDENTITY)
    """Tokens an expert takes per micro-batch and rank: capacity_factor x tokens x top_k / num_experts, the rest dropped (first choices first). 0: dropless."""


@dataclass
class EpKeys:
    """The expert-parallel degree (dtk/parallel/ep.py): part of SchemeConfig."""

    ep: int = 1
    """Expert-parallel degree (model=moe): the experts are split over ep ranks carved out of dp_shard x cp (ep divides dp_shard x cp and model.num_experts), tokens travel to their experts and back by all-to-all; the experts' parameters are FSDP-sharded over the other dp_shard x cp / ep ranks. Needs data_parallel=fsdp."""
