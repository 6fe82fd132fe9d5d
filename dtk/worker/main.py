"""The worker: environment -> device -> process group -> seeds -> model -> parallelize -> train.

The one place that wires every stage together. Started by the driver (a local process
or an srun task) as `python -m dtk.worker RUN_DIR`; reads the plan the submitter wrote.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dtk.checkpoint.manager import CheckpointManager
from dtk.checkpoint.memory_root import sweep_host
from dtk.checkpoint.memory_tier import MemoryTier
from dtk.checkpoint.rng import keep_rank_state
from dtk.config.choices import Tracker, chosen_trackers
from dtk.config.convert import to_dict
from dtk.data.loader import StepBatches, build_splits
from dtk.dist.init import init_process_group, pick_device
from dtk.dist.mesh import ParallelMesh, build_mesh
from dtk.errors import ArgumentParser, UserError
from dtk.models.build import ParallelSpec, build_model, materialize
from dtk.parallel.cp import CpLayout
from dtk.parallel.parallelize import parallelize
from dtk.parallel.precision import matmul_precision, resolve_dtype
from dtk.plan.layout import uses_zero1, zero1_reduces_gradients
from dtk.plan.plan import Plan
from dtk.report.goodput import account as goodput_account
from dtk.rundir import (
    DATA_SPLIT,
    EVAL_LOG,
    HEARTBEAT,
    PROGRESS,
    SYSTEM_LOG,
    TRACKER_STATE,
    RunDir,
    read_jsonl,
    write_json_atomic,
)
from dtk.train.divergence import Diverged, NanDrill, Rollback, read_skips
from dtk.train.evaluate import Evaluator
from dtk.train.flops import flops_per_token, peak_tflops
from dtk.train.loss import TokenCrossEntropy
from dtk.train.measure import StepMemory
from dtk.train.metrics import MetricsLog
from dtk.train.optim import SchedulerGroup, build_optimizer, build_scheduler, state_optimizer
from dtk.train.policies import STOP_VOTE_SHARE, AgreedStop, Heartbeat, ResumedEvent, StepPolicies, StopRequested
from dtk.train.profile import StepProfiler
from dtk.train.rollback import divergence_watch, roll_back
from dtk.train.startup import StartupClock
from dtk.train.sync import checkpointed, synchronizer
from dtk.train.system import SystemSampler
from dtk.train.task import LmTask, Task, build_task
from dtk.train.tensorboard import TensorBoardLog
from dtk.train.tracker import TrackerSink
from dtk.train.tracker_clients import clients
from dtk.train.trainer import Trainer, peak_memory_gib
from dtk.worker.codes import EXIT_CONFIG, EXIT_STOPPED
from dtk.worker.env import WorkerEnv, read_env
from dtk.worker.fabric import after_process_group, before_process_group, place_worker, record_placement
from dtk.worker.failure import data_function_errors, record_exception
from dtk.worker.memory import Prediction, gather_memory, is_out_of_memory, measure_index, oom_error
from dtk.worker.meshfile import record_mesh
from dtk.worker.signals import stop_flag, vote_group


def set_threads(requested: int, env: WorkerEnv) -> None:
    # Several workers on one CPU machine each default to all cores and then fight over
    # them; give each its share: what Slurm allotted the task, else the node's cores split.
    threads = requested or env.cpus_per_task or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)


def train(plan: Plan, env: WorkerEnv, run: RunDir, clock: StartupClock) -> dict:
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
    rank0 = env.rank == 0
    seed = cfg.train.seed

    mesh = build_mesh(plan.degrees, device.type)
    record_mesh(mesh, env, run)  # mesh.json: the groups as built, against plan.md
    loss = TokenCrossEntropy()  # the token loss component: the LM task and a pipeline's last stage score with it
    # what a step computes: the trainer and the evaluator run it (on this cp rank's slice of each row)
    task = build_task(cfg.task, loss=loss, cp=CpLayout.of(mesh))
    meta_model = build_model(cfg.model, device="meta", seed=seed)
    prediction = Prediction(plan, rank=env.rank, device=device, meta_model=meta_model)  # before it is sharded
    model = parallelize(
        meta_model,
        mesh=mesh,
        scheme=cfg.scheme,
        spec=ParallelSpec.from_config(cfg.model).with_model_defaults(meta_model),
        device=device,
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
        keep_rank_state(f"powersgd{i}", save=comm.state_tensors, restore=comm.load_state_tensors)
    ckpt_parts, ckpt_identity = checkpointed(
        sync, [(part, state_optimizer(o)) for part, o in zip(model.parts, optimizers, strict=True)], mesh=mesh)
    # Before the run's first step: no step completed (rank 0's progress file) and nothing to resume.
    first = not (run.path / PROGRESS).exists() and run.latest_committed_step() is None
    with data_function_errors(cfg.data, first=first):
        dataset, val_dataset = build_splits(cfg.data, model=cfg.model)
    if rank0 and hasattr(dataset, "split"):  # a user's dataset: how its split came about
        write_json_atomic(run.path / DATA_SPLIT, dataclasses.asdict(dataset.split))
    clock.lap("model")

    # Rank 0's liveness file; its thread beats from the first step on (dtk.train.policies.Heartbeat).
    heartbeat = Heartbeat(run.path / HEARTBEAT if rank0 else None, hang_timeout_s=cfg.fault.hang_timeout_s,
                          progress=run.path / PROGRESS if rank0 else None, restart=env.restart)
    if env.local_rank == 0 and not cfg.checkpoint.memory_every:  # the tier's own start sweeps when it is on
        sweep_host(run.path)  # memory stores that ended runs left on this node (dtk.checkpoint.memory_root)
    checkpoints = CheckpointManager(
        run,
        checkpoint=cfg.checkpoint,
        parts=ckpt_parts,
        scheduler=scheduler,
        mesh=mesh,
        global_batch=plan.global_batch,
        total_steps=plan.steps,
        identity={"config_hash": plan.config_hash, "data_version": dataset.version, "scheme": plan.scheme,
                  **ckpt_identity},
        busy=heartbeat.busy,  # a long save is not a hang
        memory=lambda parts, sched, identity: MemoryTier(
            run.path, every=cfg.checkpoint.memory_every, rank=env.rank, world=env.world_size, local_rank=env.local_rank,
            per_node=env.local_world_size, parts=parts, scheduler=sched, identity=identity, fresh=env.restart == 0,
            generation=len(read_skips(run.path))),  # rollbacks so far: older snapshots are abandoned
    )
    torch.manual_seed(seed + env.rank)  # per-rank stream for anything stochastic; a resume restores it
    # Beating from here on: a checkpoint load longer than fault.startup_timeout_s is no hang.
    heartbeat.start()
    with heartbeat.busy():
        start_step = checkpoints.resume()
    if start_step and not checkpoints.rng_restored:  # resumed on another world size: fresh per-rank streams
        torch.manual_seed(seed + 1000 * start_step + env.rank)

    batches = StepBatches(
        dataset,
        seed=seed,
        global_batch=plan.global_batch,
        micro_batch=plan.micro_batch,
        dp_rank=mesh.dp_rank,  # tensor and pipeline peers (same dp coordinate) read the same samples
        dp_size=mesh.dp_size,
        device=device,
        skips=read_skips(run.path),  # data windows skipped by earlier rollbacks: the recorded order
    )
    policies = step_policies(
        plan, env, run, model=model.parts[0], autocast_dtype=model.autocast_dtype, task=task, val_dataset=val_dataset,
        mesh=mesh, device=device, checkpoints=checkpoints, start_step=start_step, samples_per_epoch=len(dataset),
        heartbeat=heartbeat,
    )
    # This rank's real memory, held against the plan at the end (one step measured on the CPU).
    memory = StepMemory(device=device, parts=model.parts, optimizers=optimizers, trace=not cfg.scheme.compile,
                        index=measure_index(start_step, plan.steps))
    trainer = Trainer(
        model=model,
        optimizer=optimizers,
        scheduler=scheduler,
        batches=batches,
        task=task,
        grad_clip=cfg.optim.grad_clip,
        mesh=mesh,
        timer=policies.profile.timer,
        around_step=memory.around,
        progress=heartbeat.tick,  # each micro-batch and pipeline action is progress
        watch=divergence_watch(cfg.fault, run, start_step=start_step, comm=checkpoints.comm) if cfg.fault.divergence
        else None,
        nan_drill=NanDrill(run.path if rank0 else None),
        event=run.event if rank0 else None,
        sync=sync,
    )
    # One sampler per node, in a thread of its own: host and GPU load in system.jsonl.
    sampler = None
    if cfg.train.system_every_s > 0 and env.local_rank == 0:
        sampler = SystemSampler(run.path / SYSTEM_LOG, interval_s=cfg.train.system_every_s, rank=env.rank).start()

    if rank0:
        run.event("ready", step=start_step, restart=env.restart, **clock.ready_event())
    try:
        while True:
            try:
                last = trainer.fit(start_step=start_step, total_steps=plan.steps, policies=policies)
                break
            except Rollback as rollback:  # the verdict of every rank: all roll back together
                start_step = roll_back(rollback, run, checkpoints, batches, trainer, rank0=rank0)
    finally:
        if sampler is not None:
            sampler.stop()
        policies.metrics.close()
        policies.profile.close()
    try:
        checkpoints.close()
    finally:
        heartbeat.close()
    if checkpoints.verified_step != plan.steps:  # the final save failed: the run is not done
        raise RuntimeError(f"the final checkpoint (step {plan.steps}) could not be saved (checkpoint_failed in"
                           f" events.jsonl); the newest verified checkpoint is step {checkpoints.verified_step}")
    batches.close()
    measured = gather_memory(prediction, memory, run, rank=env.rank, world=env.world_size, step=plan.steps)

    summary = {}
    if rank0:
        records = run.latest_metrics()
        final = records.get(plan.steps)
        summary = {
            "status": "finished",
            "final_step": plan.steps,
            "final_loss": final["loss"] if final else (last.loss if last else None),
            "restarts": env.restart,
            "world_size": env.world_size,
            "scheme": plan.scheme,
            "config_hash": plan.config_hash,
            "data_version": dataset.version,
            "peak_memory_gib": peak_memory_gib(device),  # rank 0's GPU; None on the CPU
            "memory": measured,  # every rank's measured bytes against the plan's
            "flops_per_token": policies.metrics.flops_per_token,
            "peak_tflops": policies.metrics.peak_tflops,
            "goodput": goodput_account(run.events_list(), list(read_jsonl(run.metrics)), end=time.time()),
        }
        write_json_atomic(run.summary, summary)
        run.event("finished", step=plan.steps, final_loss=summary["final_loss"])
    return summary


def tracker_sinks(plan: Plan, env: WorkerEnv, run: RunDir) -> tuple[TrackerSink, ...]:
    """Rank 0's MLflow and W&B sinks (dtk.train.tracker), each logging from a thread of its own."""
    cfg = plan.config
    made = clients(chosen_trackers(cfg.train.tracker, tensorboard=False), mlflow_uri=cfg.train.mlflow_uri,
                   run_dir=run.path, config=to_dict(cfg))
    return tuple(TrackerSink(c, state=run.path / TRACKER_STATE, metrics=run.metrics, event=run.event,
                             total_steps=plan.steps, job_id=env.job_id) for c in made)


def step_policies(
    plan: Plan, env: WorkerEnv, run: RunDir, *, model: torch.nn.Module, autocast_dtype: torch.dtype | None, task: Task,
    val_dataset, mesh: ParallelMesh, device: torch.device, checkpoints: CheckpointManager, start_step: int,
    samples_per_epoch: int, heartbeat: Heartbeat,
) -> StepPolicies:
    """What runs after every step (dtk.train.policies), made for this rank: global rank 0
    writes, every rank takes part in the collective ones."""
    cfg, rank0 = plan.config, env.rank == 0
    scheme = cfg.scheme
    assert scheme is not None, "compose() sets the scheme"
    stop = stop_flag()  # installed when the process started (dtk/worker/__main__.py)
    votes = vote_group()  # host tensors on gloo: a stop vote never waits for the GPU
    agreed_stop = AgreedStop(
        agreed=lambda seconds: stop.vote(votes, seconds),
        checkpoints=checkpoints,
        total_steps=plan.steps,
        run=run if rank0 else None,
        restart=env.restart,
        budget_s=STOP_VOTE_SHARE * cfg.fault.signal_lead_floor_s,
    )

    def eval_batch_stop() -> bool:
        heartbeat.tick()  # each validation batch is progress: a long evaluation is not a hang
        return agreed_stop.poll()
    trackers = chosen_trackers(cfg.train.tracker, tensorboard=cfg.train.tensorboard)
    metrics = MetricsLog(
        run.metrics if rank0 else None,
        world_size=env.world_size,
        restart=env.restart,
        global_batch=plan.global_batch,
        tokens_per_step=plan.global_batch * (cfg.model.seq_len or 0),
        total_steps=plan.steps,
        log_every=cfg.train.log_every,
        samples_per_epoch=samples_per_epoch,
        # Rank 0 writes the records: only it counts the model's FLOPs (a user model: one traced step on meta).
        flops_per_token=flops_per_token(cfg.model) if rank0 else None,
        peak_tflops=peak_tflops(
            override=cfg.cluster.peak_tflops, accelerator=cfg.cluster.accelerator, device=device,
            dtype=resolve_dtype(scheme.param_dtype, device, auto=torch.bfloat16, key="scheme.param_dtype"),
        )[0],
        tensorboard=TensorBoardLog(run.path) if rank0 and Tracker.tensorboard in trackers else None,
        trackers=tracker_sinks(plan, env, run) if rank0 else (),
    )
    return StepPolicies(
        metrics=metrics,
        heartbeat=heartbeat,
        resumed=ResumedEvent(
            run if rank0 else None,
            start_step=start_step,
            restart=env.restart,
            world_size=env.world_size,
            recovery_from=env.recovery_from,
            job_id=env.job_id,
        ),
        evaluation=Evaluator(
            model=model,  # the plan rejects eval_every with a pipeline: the one part is the model
            dataset=val_dataset,
            task=task,
            every=cfg.train.eval_every,
            total_steps=plan.steps,
            max_samples=cfg.data.eval_samples,
            global_batch=plan.global_batch,
            micro_batch=plan.micro_batch,
            mesh=mesh,
            device=device,
            log=run.path / EVAL_LOG if rank0 else None,
            # Collective, before every validation batch: a long evaluation ends at a stop signal.
            stop_requested=eval_batch_stop,
            autocast_dtype=autocast_dtype,  # the training forward's, so val_loss compares with loss
        ),
        checkpoint=checkpoints,
        stop=agreed_stop,
        profile=StepProfiler(
            device=device,
            enabled=cfg.train.profile,
            straggler_factor=cfg.fault.straggler_factor,
            run=run if rank0 else None,
            rank=env.rank,
            log_every=cfg.train.log_every,
            total_steps=plan.steps,
            metrics=metrics,
            saving=lambda: checkpoints.saving,
            checkpointed=lambda: checkpoints.last_kept,
        ),
    )


def main(argv: list[str]) -> int:
    stop_flag()  # first: a stop signal from here on is honoured at the first step that can save
    clock = StartupClock()
    clock.lap("import")
    parser = ArgumentParser(prog="python -m dtk.worker", description="One worker process of a run; drivers start it.")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path)
    run = RunDir(parser.parse_args(argv).run_dir)
    env = read_env()
    # A driver that relaunches on fewer nodes hands the workers an adjusted plan.
    plan = Plan.from_json(Path(env.plan or run.plan_json).read_text())
    sys.path[:0] = [p for p in plan.import_path if p not in sys.path]  # the user's project folders
    # Where this rank runs, for drills and for people: logs/start_NN/rank_R.pid = "host pid".
    pid_file = run.log_dir(env.restart) / f"rank_{env.rank}.pid"
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(f"{socket.gethostname()} {os.getpid()}\n")
    try:
        train(plan, env, run, clock)
    except StopRequested as stop:
        print(f"worker {env.rank}: {stop}", flush=True)
        return EXIT_STOPPED
    except Diverged as diverged:  # a relaunch diverges again: the drivers stop the run
        print(f"error: {diverged}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except Exception as exc:
        if not is_out_of_memory(exc):
            if not isinstance(exc, UserError):  # a configuration error fails at once anyway
                record_exception(run, start=env.restart, rank=env.rank, exc=exc)  # the driver compares starts
            raise
        # Not a crash to relaunch: the same job runs out again. One line, the driver's to report.
        device = pick_device(plan.config.dist.device, env)
        print(f"error: {oom_error(plan, None, rank=env.rank, device=device)}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
