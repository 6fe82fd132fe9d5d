"""The worker: environment -> device -> process group -> seeds -> model -> parallelize -> train.

The one place that wires every stage together. Started by the driver (a local process
or an srun task) as `python -m dtk.worker RUN_DIR`; reads the plan the submitter wrote.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from dtk.checkpoint.manager import CheckpointManager
from dtk.data.loader import StepBatches, build_splits
from dtk.dist.init import init_process_group, pick_device
from dtk.dist.mesh import build_mesh
from dtk.models.build import ParallelSpec, build_model, materialize
from dtk.parallel.parallelize import parallelize
from dtk.plan.degrees import DP, Axis
from dtk.plan.plan import Plan
from dtk.report.goodput import account as goodput_account
from dtk.rundir import RunDir, read_jsonl, write_json_atomic
from dtk.train.evaluate import EVAL_LOG, Evaluator
from dtk.train.metrics import MetricsLog
from dtk.train.optim import SchedulerGroup, build_optimizer, build_scheduler, state_optimizer
from dtk.train.startup import StartupClock
from dtk.train.trainer import Trainer, cross_entropy, peak_memory_gib
from dtk.worker.codes import EXIT_STOPPED
from dtk.worker.env import WorkerEnv, read_env
from dtk.worker.heartbeat import HEARTBEAT, Heartbeat
from dtk.worker.signals import StopFlag, StopRequested


def set_threads(requested: int, local_world_size: int) -> None:
    # Several workers on one CPU machine each default to all cores and then fight over
    # them; give each its share: what Slurm allotted the task, else the node's cores split.
    allotted = int(os.environ.get("SLURM_CPUS_PER_TASK", "0"))
    threads = requested or allotted or max(1, (os.cpu_count() or 1) // local_world_size)
    torch.set_num_threads(threads)


def train(plan: Plan, env: WorkerEnv, run: RunDir, clock: StartupClock) -> dict:
    cfg = plan.config
    device = pick_device(cfg.dist.device, env)
    if device.type == "cpu":
        set_threads(cfg.train.threads, env.local_world_size)
    init_process_group(env, backend=cfg.dist.backend, device=device, timeout_s=cfg.dist.timeout_s)
    clock.lap("process_group")
    rank0 = env.rank == 0
    restart = int(os.environ.get("DTK_RESTART", "0"))
    seed = cfg.train.seed

    scheme = cfg.scheme
    mesh = build_mesh(plan.degrees, device.type)
    dp_group = mesh.group(DP)
    model = parallelize(
        build_model(cfg.model, device="meta", seed=seed),
        mesh=mesh,
        degrees=plan.degrees,
        scheme=scheme,
        spec=ParallelSpec.from_config(cfg.model),
        device=device,
        materialize=lambda parts: materialize(parts, model_cfg=cfg.model, device=device, seed=seed),
        loss_fn=cross_entropy,
        num_microbatches=plan.grad_accum,
    )
    # One optimizer per model part (pipeline stage), so a checkpoint holds (part, optimizer) pairs.
    shard_group = dp_group if scheme.shard_optimizer and plan.degrees.dp > 1 else None
    optimizers = [build_optimizer(part.parameters(), optim=cfg.optim, shard_group=shard_group) for part in model.parts]
    scheduler = SchedulerGroup(
        [build_scheduler(state_optimizer(o), optim=cfg.optim, total_steps=plan.steps) for o in optimizers]
    )
    dataset, val_dataset = build_splits(cfg.data, model=cfg.model)
    clock.lap("model")

    checkpoints = CheckpointManager(
        run,
        checkpoint=cfg.checkpoint,
        parts=[(part, state_optimizer(o)) for part, o in zip(model.parts, optimizers, strict=True)],
        scheduler=scheduler,
        rank=env.rank,
        world_size=env.world_size,
        global_batch=plan.global_batch,
        total_steps=plan.steps,
        identity={
            "config_hash": plan.config_hash,
            "data_version": dataset.version,
            "scheme": plan.scheme,
            "mesh": asdict(plan.degrees),
        },
    )
    torch.manual_seed(seed + env.rank)  # per-rank stream for anything stochastic; a resume restores it
    start_step = checkpoints.resume()
    if start_step and not checkpoints.rng_restored:  # resumed on another world size: fresh per-rank streams
        torch.manual_seed(seed + 1000 * start_step + env.rank)

    # Ranks with the same dp coordinate (tensor / pipeline peers) train on the same samples.
    dp_rank, dp_size = mesh.rank(DP), plan.degrees.dp
    batches = StepBatches(
        dataset,
        seed=seed,
        global_batch=plan.global_batch,
        micro_batch=plan.micro_batch,
        dp_rank=dp_rank,
        dp_size=dp_size,
        device=device,
    )
    metrics = (
        MetricsLog(
            run.metrics,
            world_size=env.world_size,
            restart=restart,
            tokens_per_step=plan.global_batch * (cfg.model.seq_len or 0),
            total_steps=plan.steps,
            log_every=cfg.train.log_every,
        )
        if rank0
        else None
    )
    trainer = Trainer(
        model=model,
        optimizer=optimizers,
        scheduler=scheduler,
        batches=batches,
        grad_clip=cfg.optim.grad_clip,
        dp_group=dp_group,
        pp_group=mesh.group(Axis.pp) if plan.degrees.pp > 1 else None,
        metrics=metrics,
    )
    stop = StopFlag().install()
    evaluator = Evaluator(
        model=model.parts[0],  # the plan rejects eval_every with a pipeline
        dataset=val_dataset,
        every=cfg.train.eval_every,
        total_steps=plan.steps,
        max_samples=cfg.data.eval_samples,
        global_batch=plan.global_batch,
        micro_batch=plan.micro_batch,
        dp_rank=dp_rank,
        dp_size=dp_size,
        dp_group=dp_group,
        device=device,
        log=run.path / EVAL_LOG if rank0 else None,
        stop_requested=lambda: stop.agreed(device) != 0,
    )

    heartbeat = Heartbeat(run.path / HEARTBEAT if rank0 else None)
    heartbeat.beat()

    recovery_from = float(os.environ.get("DTK_RECOVERY_FROM") or 0)

    def on_step_end(step: int, result) -> None:
        heartbeat.beat()
        if rank0 and step == start_step + 1 and start_step:
            # The first completed step after a restart closes the recovery it belongs to.
            recovery_s = round(time.time() - recovery_from, 3) if recovery_from else None
            run.event("resumed", step=start_step, restart=restart, world_size=env.world_size, recovery_s=recovery_s,
                      job_id=os.environ.get("SLURM_JOB_ID"))
        evaluator.on_step_end(step, result)
        checkpoints.on_step_end(step, result)
        heartbeat.beat()
        signum = stop.agreed(device) if step < plan.steps else 0
        if signum:
            if not checkpoints.due(step):
                checkpoints.save(step)
            checkpoints.close()  # the stop is only safe once the save is committed
            if rank0:
                run.event("preempted", step=step, signal=signal.Signals(signum).name, restart=restart)
            raise StopRequested(step, signum)

    if rank0:
        run.event("ready", step=start_step, restart=restart, **clock.ready_event())
    last = trainer.fit(start_step=start_step, total_steps=plan.steps, on_step_end=on_step_end)
    checkpoints.close()
    batches.close()

    summary = {}
    if rank0:
        records = run.latest_metrics()
        final = records.get(plan.steps)
        summary = {
            "status": "finished",
            "final_step": plan.steps,
            "final_loss": final["loss"] if final else (last.loss if last else None),
            "restarts": restart,
            "world_size": env.world_size,
            "scheme": plan.scheme,
            "config_hash": plan.config_hash,
            "data_version": dataset.version,
            "peak_memory_gib": peak_memory_gib(device),  # rank 0's GPU; None on the CPU
            "goodput": goodput_account(run.events_list(), list(read_jsonl(run.metrics)), end=time.time()),
        }
        write_json_atomic(run.summary, summary)
        run.event("finished", step=plan.steps, final_loss=summary["final_loss"])
    return summary


def main(argv: list[str]) -> int:
    clock = StartupClock()
    clock.lap("import")
    if len(argv) != 1:
        print("usage: python -m dtk.worker RUN_DIR", file=sys.stderr)
        return 2
    run = RunDir(Path(argv[0]))
    # A driver that relaunches on fewer nodes hands the workers an adjusted plan.
    plan = Plan.from_json(Path(os.environ.get("DTK_PLAN") or run.plan_json).read_text())
    sys.path[:0] = [p for p in plan.import_path if p not in sys.path]  # the user's project folders
    env = read_env()
    # Where this rank runs, for drills and for people: logs/start_NN/rank_R.pid = "host pid".
    restart = int(os.environ.get("DTK_RESTART", "0"))
    pid_file = run.log_dir(restart) / f"rank_{env.rank}.pid"
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(f"{socket.gethostname()} {os.getpid()}\n")
    try:
        train(plan, env, run, clock)
    except StopRequested as stop:
        print(f"worker {env.rank}: {stop}; checkpoint committed", flush=True)
        return EXIT_STOPPED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
