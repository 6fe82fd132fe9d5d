"""The worker's stages before the loop, each one seam of dtk/worker/main.py's `train`: the
process group and mesh, the model and its optimizers, the checkpoints and where the run
resumes. Each returns what the later ones are handed; none of them runs a step."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from dtk.checkpoint.manager import CheckpointManager
from dtk.checkpoint.memory.root import sweep_host
from dtk.checkpoint.memory.tier import MemoryTier
from dtk.checkpoint.rng import keep_rank_state
from dtk.common.rundir import DATA_SPLIT, HEARTBEAT, PROGRESS, RunDir, write_json_atomic
from dtk.common.storage import latest_committed_step, run_storage
from dtk.data.loader import build_splits
from dtk.mesh.init import init_process_group, pick_device
from dtk.mesh.mesh import ParallelMesh, build_mesh
from dtk.models.build import ParallelSpec, build_model, materialize
from dtk.parallel.cp import CpLayout
from dtk.parallel.parallelize import Parallelized, parallelize
from dtk.parallel.precision import matmul_precision
from dtk.plan.layout import uses_zero1, zero1_reduces_gradients
from dtk.plan.plan import Plan
from dtk.train.divergence import read_skips
from dtk.train.loss import TokenCrossEntropy
from dtk.train.optim import SchedulerGroup, build_optimizer, build_scheduler, state_optimizer
from dtk.train.policies import Heartbeat
from dtk.train.startup import StartupClock
from dtk.train.sync import checkpointed, synchronizer
from dtk.train.task import LmTask, Task, build_task
from dtk.worker.env import WorkerEnv
from dtk.worker.fabric import after_process_group, before_process_group, place_worker, record_placement
from dtk.worker.failure import data_function_errors
from dtk.worker.memory import Prediction
from dtk.worker.meshfile import record_mesh


@dataclass(frozen=True)
class Worker:
    """What every stage of this rank is handed: its plan, environment, run directory,
    device and mesh."""

    plan: Plan
    env: WorkerEnv
    run: RunDir
    device: torch.device
    mesh: ParallelMesh

    @property
    def rank0(self) -> bool:
        return self.env.rank == 0


@dataclass
class Built:
    """The model as this rank trains it, its optimizers, and what they are trained on."""

    task: Task
    model: Parallelized
    optimizers: list[Any]
    scheduler: SchedulerGroup
    sync: Any
    """dtk.train.sync's synchronizer; None: replicas agree every step."""
    ckpt_parts: list[Any]
    ckpt_identity: dict[str, Any]
    dataset: Any
    val_dataset: Any
    prediction: Prediction
    """This rank's planned memory, as plan.json hands it."""


def set_threads(requested: int, env: WorkerEnv) -> None:
    # Several workers on one CPU machine each default to all cores and then fight over
    # them; give each its share: what Slurm allotted the task, else the node's cores split.
    threads = requested or env.cpus_per_task or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)


def start_group(plan: Plan, env: WorkerEnv, run: RunDir, clock: StartupClock) -> Worker:
    """The device, the process group and the mesh; the environment as the fabric left it."""
    cfg = plan.config
    assert cfg.scheme is not None, "compose() sets the scheme"
    placement = place_worker(plan, env, run)  # its GPU, and the CPUs of that GPU's NUMA node
    device = pick_device(cfg.dist.device, env, index=placement.device_index)
    torch.set_float32_matmul_precision(matmul_precision(cfg.scheme.matmul_precision, device))  # TF32 on purpose
    if device.type == "cpu":
        set_threads(cfg.train.threads, env)
    # The fabric's variables (interfaces, HCAs, master address) must be set before the group starts.
    env, fabric = before_process_group(plan, env, run, device=device)
    init_process_group(env, backend=cfg.dist.backend, device=device, timeout_s=cfg.dist.timeout_s,
                       cpu_collectives=cfg.scheme.cpu_offload)
    after_process_group(fabric, plan, env, run, device=device)  # stops here when NCCL bypasses InfiniBand
    record_placement(placement, env, run)
    clock.lap("process_group")
    mesh = build_mesh(plan.degrees, device.type)
    record_mesh(mesh, env, run)  # mesh.json: the groups as built, against plan.md
    return Worker(plan=plan, env=env, run=run, device=device, mesh=mesh)


def build(w: Worker) -> Built:
    """The task, the parallelized model, one optimizer per model part, and the data splits."""
    plan, cfg, mesh = w.plan, w.plan.config, w.mesh
    assert cfg.scheme is not None, "compose() sets the scheme"
    seed = cfg.train.seed
    loss = TokenCrossEntropy()  # the token loss component: the LM task and a pipeline's last stage score with it
    # what a step computes: the trainer and the evaluator run it (on this cp rank's slice of each row)
    task = build_task(cfg.task, loss=loss, cp=CpLayout.of(mesh))
    meta_model = build_model(cfg.model, device="meta", seed=seed)
    prediction = Prediction(plan, rank=w.env.rank, device=w.device)  # the figures plan.json hands this rank
    model = parallelize(
        meta_model,
        mesh=mesh,
        scheme=cfg.scheme,
        spec=ParallelSpec.from_config(cfg.model).with_model_defaults(meta_model),
        device=w.device,
        materialize=lambda parts, on: materialize(parts, model_cfg=cfg.model, device=on, seed=seed),
        loss_fn=loss,
        num_microbatches=plan.grad_accum,
        # the token loss computes on vocabulary shards; a user's loss or metric gets whole logits
        sharded_logits=isinstance(task, LmTask) and not task.metrics,
        local_replicas=cfg.sync is not None,  # +sync: replicas step on their own (dtk.train.sync)
    )
    # One optimizer per model part (pipeline stage), so a checkpoint holds (part, optimizer) pairs.
    shard_group = mesh.dp_group if uses_zero1(cfg.scheme, mesh.degrees) else None
    reduces = zero1_reduces_gradients(cfg.scheme, mesh.degrees)  # ZeRO-1 with tp: no DDP, it all-reduces itself
    optimizers = [build_optimizer(part.parameters(), optim=cfg.optim, shard_group=shard_group, reduces_gradients=reduces)
                  for part in model.parts]
    scheduler = SchedulerGroup(
        [build_scheduler(state_optimizer(o), optim=cfg.optim, total_steps=plan.steps) for o in optimizers]
    )
    sync = synchronizer(cfg.sync, model=model.parts[0], mesh=mesh, total_steps=plan.steps)  # None: every step
    for i, comm in enumerate(model.comm_states):  # PowerSGD's error feedback: in each rank's own checkpoint file
        comm.start_after(cfg.optim.warmup_steps)  # compressed once the learning rate's warm-up is over
        keep_rank_state(f"powersgd{i}", save=comm.state_tensors, restore=comm.load_state_tensors)
    ckpt_parts, ckpt_identity = checkpointed(
        sync, [(part, state_optimizer(o)) for part, o in zip(model.parts, optimizers, strict=True)], mesh=mesh)
    # Before the run's first step: no step completed (rank 0's progress file) and nothing to resume.
    first = not (w.run.path / PROGRESS).exists() and latest_committed_step(run_storage(w.run, cfg.checkpoint.dir)) is None
    with data_function_errors(cfg.data, first=first):
        dataset, val_dataset = build_splits(cfg.data, model=cfg.model)
    if w.rank0 and hasattr(dataset, "split"):  # a user's dataset: how its split came about
        write_json_atomic(w.run.path / DATA_SPLIT, dataclasses.asdict(dataset.split))
    return Built(task=task, model=model, optimizers=optimizers, scheduler=scheduler, sync=sync,
                 ckpt_parts=ckpt_parts, ckpt_identity=ckpt_identity, dataset=dataset, val_dataset=val_dataset,
                 prediction=prediction)


def heartbeat_of(w: Worker) -> Heartbeat:
    """Rank 0's liveness file; its thread beats from the first step on (dtk.train.policies.Heartbeat)."""
    run = w.run
    return Heartbeat(run.path / HEARTBEAT if w.rank0 else None, hang_timeout_s=w.plan.config.fault.hang_timeout_s,
                     progress=run.path / PROGRESS if w.rank0 else None, restart=w.env.restart)


def open_checkpoints(w: Worker, built: Built, heartbeat: Heartbeat) -> CheckpointManager:
    """The run's checkpoints of this rank's parts, with the memory tier when it is on."""
    plan, cfg, env, run = w.plan, w.plan.config, w.env, w.run
    if env.local_rank == 0 and not cfg.checkpoint.memory_every:  # the tier's own start sweeps when it is on
        sweep_host(run.path)  # memory stores that ended runs left on this node (dtk.checkpoint.memory.root)
    return CheckpointManager(
        run,
        checkpoint=cfg.checkpoint,
        parts=built.ckpt_parts,
        scheduler=built.scheduler,
        mesh=w.mesh,
        global_batch=plan.global_batch,
        total_steps=plan.steps,
        identity={"config_hash": plan.config_hash, "data_version": built.dataset.version, "scheme": plan.scheme,
                  **built.ckpt_identity},
        busy=heartbeat.busy,  # a long save is not a hang
        memory=lambda parts, sched, identity: MemoryTier(
            run.path, every=cfg.checkpoint.memory_every, rank=env.rank, world=env.world_size, local_rank=env.local_rank,
            per_node=env.local_world_size, parts=parts, scheduler=sched, identity=identity, fresh=env.restart == 0,
            generation=len(read_skips(run.path))),  # rollbacks so far: older snapshots are abandoned
    )


def resume(w: Worker, checkpoints: CheckpointManager, heartbeat: Heartbeat) -> int:
    """Seed this rank, start the heartbeat and load the newest checkpoint: the step to start from."""
    seed, rank = w.plan.config.train.seed, w.env.rank
    torch.manual_seed(seed + rank)  # per-rank stream for anything stochastic; a resume restores it
    # Beating from here on: a checkpoint load longer than fault.startup_timeout_s is no hang.
    heartbeat.start()
    with heartbeat.busy():
        start_step = checkpoints.resume()
    if start_step and not checkpoints.rng_restored:  # resumed on another world size: fresh per-rank streams
        torch.manual_seed(seed + 1000 * start_step + rank)
    return start_step
