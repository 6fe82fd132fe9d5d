"""The allowed values of every closed-set configuration key, once, torch-free.

Each is an Enum whose member names are what a user types in YAML or on the command line
(lowercase), so OmegaConf checks them while it composes: a typo stops on the login node
with the key, the value and the allowed values, not in a worker after the queue wait.
The schema (dtk/config/schema.py) types its fields with these; plan/ and parallel/ import
them from here and map each member to what it means (a torch schedule, a dtype, a style),
and tests check that every such table covers every member.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A closed set of lowercase strings. A member is its string (`==`, json, f-strings)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class ClusterKind(Choice):
    local = "local"
    slurm = "slurm"


class DataKind(Choice):
    synthetic = "synthetic"
    hdf5 = "hdf5"
    user = "user"


class TaskForm(Choice):
    """What a user's task callable (`task._target_`) is handed first (dtk/train/task.py)."""

    outputs = "outputs"
    model = "model"


class OptimizerName(Choice):
    adamw = "adamw"


class DataParallel(Choice):
    ddp = "ddp"
    fsdp = "fsdp"


class SyncMode(Choice):
    """How data-parallel replicas synchronize when they do not every step (group `sync`, dtk/train/sync.py)."""

    local_sgd = "local_sgd"
    diloco = "diloco"


class SyncDtype(Choice):
    """What diloco's replicas send of their deltas (sync.dtype, dtk/train/sync.py maps each)."""

    float32 = "float32"
    bfloat16 = "bfloat16"


class GradCompression(Choice):
    """What DDP's every-step gradient all-reduce sends (scheme.grad_compression, dtk/parallel/compression.py)."""

    none = "none"
    bf16 = "bf16"
    powersgd = "powersgd"


class AsyncMode(Choice):
    """Who writes an asynchronous checkpoint's shards (dtk/checkpoint/sharded.py)."""

    thread = "thread"
    process = "process"


# "1f1b" is not a Python identifier, so this one is made with the functional API; code
# names its members by value: PipelineSchedule("1f1b").
# mypy reads a call of a str-mixin Enum as str's constructor, not the functional API.
PipelineSchedule = Choice(  # type: ignore[call-overload]
    "PipelineSchedule",
    [("gpipe", "gpipe"), ("1f1b", "1f1b"), ("interleaved_1f1b", "interleaved_1f1b")],
    module=__name__,
    qualname="PipelineSchedule",
)


class ActivationCheckpoint(Choice):
    none = "none"
    selective = "selective"
    full = "full"


class Dtype(Choice):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class MatmulPrecision(Choice):
    """torch.set_float32_matmul_precision (dtk/parallel/precision.py maps each)."""

    auto = "auto"
    highest = "highest"
    high = "high"
    medium = "medium"


class TpStyle(Choice):
    """What a module named in `model.tp_plan` becomes (dtk/parallel/tp.py has the table)."""

    colwise = "colwise"
    rowwise = "rowwise"
    colwise_output = "colwise_output"
    sequence_parallel = "sequence_parallel"
    sequence_gather = "sequence_gather"


class Backend(Choice):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class FabricRequire(Choice):
    """What the transport check at start accepts (dtk.topology.nccl.REQUIRE)."""

    auto = "auto"
    ib = "ib"
    any = "any"


class DeviceKind(Choice):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class Tracker(Choice):
    """An experiment tracker rank 0 logs the metrics to (train.tracker, dtk/train/tracker.py)."""

    tensorboard = "tensorboard"
    mlflow = "mlflow"
    wandb = "wandb"


TRACKER_MODULES = {Tracker.tensorboard: "tensorboard", Tracker.mlflow: "mlflow", Tracker.wandb: "wandb"}
"""The package each tracker needs; submit checks it is installed (importlib.util.find_spec)."""


def chosen_trackers(tracker: list[Tracker], *, tensorboard: bool) -> tuple[Tracker, ...]:
    """train.tracker, with `tensorboard` added by the older train.tensorboard=true; each once, in order."""
    chosen = [Tracker(t) for t in tracker] + ([Tracker.tensorboard] if tensorboard else [])
    return tuple(dict.fromkeys(chosen))
