"""validate + plan: a frozen, printable plan from a resolved config. Pure: no torch, no I/O."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dtk.errors import UserError
from dtk.plan.degrees import Degrees, check_scheme, default_scheme, micro_batch_size, resolve_degrees

CLUSTER_KINDS = ("local", "slurm")
DEFAULT_CPU_TASKS = 2  # workers per node when neither tasks_per_node nor GPUs say otherwise
BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cuda", "cpu")

# The keys that make a run what it is. Resubmitting with only other keys changed (nodes,
# scheme, cluster, checkpoint interval, micro batch) continues the same run directory.
SEMANTIC_KEYS = ("model", "data", "optim", "train.steps", "train.global_batch", "train.seed")


@dataclass(frozen=True)
class Plan:
    """Everything a launch needs, derived once on the submitting machine."""

    config: dict[str, Any]
    run_name: str
    run_dir: str
    config_hash: str
    cluster_kind: str
    nodes: int
    tasks_per_node: int
    world_size: int
    scheme: str
    degrees: Degrees
    global_batch: int
    micro_batch: int
    grad_accum: int
    steps: int
    spare_nodes: int = 0
    import_path: tuple[str, ...] = ()
    """The user's project folders: workers put them first on their import path (see SearchPath)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Plan:
        raw = json.loads(text)
        raw["degrees"] = Degrees(**raw["degrees"])
        raw["import_path"] = tuple(raw.get("import_path", ()))
        return Plan(**raw)

    def describe(self) -> str:
        d = self.degrees
        lines = [
            f"run         {self.run_dir}",
            f"cluster     {self.cluster_kind}: {self.nodes} node(s) × {self.tasks_per_node} worker(s) = world {self.world_size}",
            f"scheme      {self.scheme}: dp_replicate={d.dp_replicate} dp_shard={d.dp_shard} tp={d.tp} pp={d.pp}",
            f"batch       global {self.global_batch} = micro {self.micro_batch} × accumulation {self.grad_accum}"
            f" × data-parallel {d.dp}",
            f"train       {self.steps} steps, checkpoint every {self.config['checkpoint']['every']},"
            f" keep {self.config['checkpoint']['keep']}",
        ]
        return "\n".join(lines)


def semantic_hash(cfg: dict[str, Any]) -> str:
    picked = {key: _get(cfg, key) for key in SEMANTIC_KEYS}
    blob = json.dumps(picked, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def _get(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def _model_name(model: dict[str, Any]) -> str:
    target = str(model.get("_target_", "model"))
    parts = target.split(".")
    # "dtk.models.transformer.build" -> "transformer": the module says more than "build".
    name = parts[-2] if len(parts) >= 2 and parts[-1] in ("build", "create", "make") else parts[-1]
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in name.lower()) or "model"


AFTER_RE = re.compile(r"^\d+(_\d+)?(:\d+(_\d+)?)*$")


def check_after(after: str | None, cluster_kind: str) -> None:
    """`submit.after` names Slurm job ids, and only a Slurm job can wait for them."""
    if after is None:
        return
    if not AFTER_RE.match(str(after)):
        raise UserError(f"submit.after={after}: expected a Slurm job id, or several joined by ':' (submit.after=4711"
                        " or submit.after=4711:4712)")
    if cluster_kind != "slurm":
        raise UserError(f"submit.after={after}: only a Slurm job can wait for another (cluster.kind={cluster_kind});"
                        " use cluster=slurm or a site's cluster file")


def make_plan(cfg: dict[str, Any], *, cwd: str | Path | None = None, import_path: tuple[str, ...] = ()) -> Plan:
    """Validate the config and derive the plan. Raises UserError with the arithmetic."""
    cluster = cfg["cluster"]
    nodes, tpn = cfg["nodes"], cfg["tasks_per_node"]
    if tpn is None:
        tpn = cluster["gpus_per_node"] or DEFAULT_CPU_TASKS
    train = cfg["train"]
    _positive("nodes", nodes)
    _positive("tasks_per_node", tpn)
    spares = cfg.get("spare_nodes", 0)
    if not isinstance(spares, int) or spares < 0:
        raise UserError(f"spare_nodes={spares}: expected 0 or a positive count of extra nodes")
    if spares and cluster["kind"] == "local":
        raise UserError(f"spare_nodes={spares}: spare nodes need a Slurm cluster; the local cluster has one machine")
    fault = cfg.get("fault") or {}
    if fault and fault["max_restarts"] < 0:
        raise UserError(f"fault.max_restarts={fault['max_restarts']}: expected 0 or more")
    for key in ("hang_timeout_s", "startup_timeout_s"):
        if fault and fault[key] < 1:
            raise UserError(f"fault.{key}={fault[key]}: expected a positive number of seconds")
    if cluster["kind"] not in CLUSTER_KINDS:
        raise UserError(f"cluster.kind={cluster['kind']}: expected one of {', '.join(CLUSTER_KINDS)}")
    check_after(cfg["submit"]["after"], cluster["kind"])
    if cluster["kind"] == "local" and nodes != 1:
        raise UserError(
            f"nodes={nodes}: the local cluster is this one machine, so nodes must be 1 "
            f"(use tasks_per_node={nodes * tpn} for {nodes * tpn} workers here, or cluster=slurm / cluster=lab)"
        )
    for key in ("steps", "global_batch", "log_every"):
        _positive(f"train.{key}", train[key])
    if train["threads"] < 0:
        raise UserError(f"train.threads={train['threads']}: expected 0 (automatic) or a positive count")
    ckpt = cfg["checkpoint"]
    if ckpt["every"] < 0:
        raise UserError(f"checkpoint.every={ckpt['every']}: expected 0 (only at the end) or a positive step count")
    _positive("checkpoint.keep", ckpt["keep"])
    optim = cfg["optim"]
    if not optim["lr"] > 0:
        raise UserError(f"optim.lr={optim['lr']}: expected a positive learning rate")
    if optim["warmup_steps"] < 0:
        raise UserError(f"optim.warmup_steps={optim['warmup_steps']}: expected 0 or more")
    if cfg["dist"]["backend"] not in BACKENDS:
        raise UserError(f"dist.backend={cfg['dist']['backend']}: expected one of {', '.join(BACKENDS)}")
    if cfg["dist"]["device"] not in DEVICES:
        raise UserError(f"dist.device={cfg['dist']['device']}: expected one of {', '.join(DEVICES)}")
    _positive("dist.timeout_s", cfg["dist"]["timeout_s"])
    _check_model(cfg["model"])

    world = nodes * tpn
    scheme = cfg.get("scheme") or default_scheme()
    degrees = resolve_degrees(scheme, world)
    global_batch = train["global_batch"]
    if global_batch % degrees.dp:
        raise UserError(
            f"train.global_batch={global_batch} does not split over the data-parallel size {degrees.dp}"
            f" ({global_batch} / {degrees.dp} = {global_batch / degrees.dp:.2f});"
            f" try train.global_batch={degrees.dp * max(1, round(global_batch / degrees.dp))}"
        )
    micro = micro_batch_size(scheme, micro_batch=train["micro_batch"], global_batch=global_batch, degrees=degrees)
    _positive("train.micro_batch", micro)
    per_step = micro * degrees.dp
    if global_batch % per_step:
        raise UserError(
            f"train.global_batch={global_batch} is not a multiple of train.micro_batch × data-parallel size"
            f" = {micro} × {degrees.dp} = {per_step}; try train.global_batch={per_step * max(1, round(global_batch / per_step))}"
            f" or a train.micro_batch that divides {global_batch // degrees.dp if global_batch % degrees.dp == 0 else global_batch}"
        )
    check_scheme(
        scheme, degrees, cfg["model"], n_microbatches=global_batch // per_step, eval_every=train.get("eval_every", 0)
    )
    digest = semantic_hash(cfg)
    name = cfg["run"]["name"] or f"{_model_name(cfg['model'])}-{digest}"
    if "/" in name or name in (".", ".."):
        raise UserError(f"run.name={name}: expected a plain folder name without '/'")
    root = Path(cfg["run"]["root"]).expanduser()
    if not root.is_absolute():
        root = Path(cwd or Path.cwd()) / root
    return Plan(
        config=cfg,
        run_name=name,
        run_dir=str(root / name),
        config_hash=digest,
        cluster_kind=cluster["kind"],
        nodes=nodes,
        spare_nodes=spares,
        tasks_per_node=tpn,
        world_size=world,
        scheme=scheme["name"],
        degrees=degrees,
        global_batch=global_batch,
        micro_batch=micro,
        grad_accum=global_batch // per_step,
        steps=train["steps"],
        import_path=tuple(str(p) for p in import_path),
    )


def _positive(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{key}={value}: expected a positive integer")


def _check_model(model: dict[str, Any]) -> None:
    """Checks for the built-in transformer; a user model's own factory checks its keys."""
    if "n_heads" not in model or "dim" not in model:
        return
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "seq_len"):
        _positive(f"model.{key}", model[key])
    if model["dim"] % model["n_heads"]:
        raise UserError(
            f"model.n_heads={model['n_heads']} does not divide model.dim={model['dim']}"
            f" ({model['dim']} / {model['n_heads']} = {model['dim'] / model['n_heads']:.2f});"
            f" try n_heads={math.gcd(model['dim'], model['n_heads'])}"
        )
