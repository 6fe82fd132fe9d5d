"""validate + plan: a frozen, printable plan from a typed config. Pure: no torch, no I/O but the
one read of run identity (an existing run directory's plan.json, dtk/plan/identity.py). The checks
of each config section are dtk/plan/checks.py's."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.common.rundir import RunDir
from dtk.config.choices import ClusterKind, DeviceKind
from dtk.config.convert import from_dict, to_dict
from dtk.config.hf_json import HF_TARGET as HF_TARGET  # dtk.checkpoint.formats reads it from here
from dtk.config.schema import Config, SchemeConfig
from dtk.plan.checks import check_config
from dtk.plan.degrees import Degrees
from dtk.plan.identity import run_identity

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
    dtk.plan.cost.gate.planned_memory; the workers hold their measurement against them. None: a
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
    `local_gpus`: the GPUs this machine shows (dtk.plan.cost.inputs.visible_gpus), which the
    local cluster starts one worker per by default."""
    nodes, tpn = cfg.nodes, cfg.tasks_per_node
    gpus, gpus_from = gpus_per_node(cfg, local_gpus)
    if tpn is None:
        tpn = gpus or DEFAULT_CPU_TASKS
    layout = check_config(cfg, tasks_per_node=tpn, gpus=gpus, gpus_from=gpus_from, import_path=import_path)
    scheme = cfg.scheme
    assert scheme is not None, "compose() sets the scheme"
    root = Path(cfg.run.root).expanduser()
    if not root.is_absolute():
        root = Path(cwd or Path.cwd()) / root
    # The identity keys name the run; a run directory an earlier release named keeps its name.
    name, digest = run_identity(cfg, root)
    global_batch = cfg.train.global_batch
    return Plan(
        config=cfg,
        run_name=name,
        run_dir=str(root / name),
        config_hash=digest,
        cluster_kind=cfg.cluster.kind,
        nodes=nodes,
        spare_nodes=cfg.spare_nodes,
        tasks_per_node=tpn,
        world_size=layout.world,
        scheme=scheme.name,
        degrees=layout.degrees,
        global_batch=global_batch,
        micro_batch=layout.micro_batch,
        grad_accum=global_batch // layout.per_step,
        steps=cfg.train.steps,
        import_path=tuple(str(p) for p in import_path),
    )


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
