"""The worker: environment -> device -> process group -> seeds -> model -> parallelize -> train.

The one place that wires every stage together. Started by the driver (a local process
or an srun task) as `python -m dtk.worker RUN_DIR`; reads the plan the submitter wrote.
`train` reads as the run's seams, in order: the process group and mesh, the model and its
optimizers, the checkpoints (dtk/worker/wiring.py), the step policies (dtk/worker/policies.py),
the loop (here), and summary.json (dtk/report/summary.py).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dtk.checkpoint.manager import CheckpointManager
from dtk.common.errors import ArgumentParser, UserError
from dtk.common.rundir import SYSTEM_LOG, RunDir
from dtk.data.loader import StepBatches
from dtk.mesh.init import pick_device
from dtk.plan.plan import Plan
from dtk.report.summary import Finished, write_summary
from dtk.train.divergence import Diverged, NanDrill, Rollback, read_skips
from dtk.train.measure import StepMemory
from dtk.train.policies import StepPolicies, StopRequested
from dtk.train.rollback import divergence_watch, roll_back
from dtk.train.startup import StartupClock
from dtk.train.system import SystemSampler
from dtk.train.trainer import Trainer, peak_memory_gib
from dtk.worker.codes import EXIT_CONFIG, EXIT_STOPPED
from dtk.worker.env import WorkerEnv, read_env
from dtk.worker.failure import record_exception
from dtk.worker.memory import gather_memory, is_out_of_memory, measure_index, oom_error
from dtk.worker.policies import step_policies
from dtk.worker.signals import stop_flag
from dtk.worker.wiring import Built, Worker, build, heartbeat_of, open_checkpoints, resume, start_group


def train(plan: Plan, env: WorkerEnv, run: RunDir, clock: StartupClock) -> dict:
    """This rank's part of the run, from the process group to summary.json (rank 0 returns it)."""
    w = start_group(plan, env, run, clock)  # the environment as the fabric set it, the device and the mesh
    built = build(w)
    clock.lap("model")
    heartbeat = heartbeat_of(w)
    checkpoints = open_checkpoints(w, built, heartbeat)
    start_step = resume(w, checkpoints, heartbeat)
    batches = StepBatches(
        built.dataset,
        seed=plan.config.train.seed,
        global_batch=plan.global_batch,
        micro_batch=plan.micro_batch,
        dp_rank=w.mesh.dp_rank,  # tensor and pipeline peers (same dp coordinate) read the same samples
        dp_size=w.mesh.dp_size,
        device=w.device,
        skips=read_skips(run.path),  # data windows skipped by earlier rollbacks: the recorded order
    )
    policies = step_policies(w, built, checkpoints=checkpoints, heartbeat=heartbeat, start_step=start_step)
    # This rank's real memory, held against the plan at the end (one step measured on the CPU).
    assert plan.config.scheme is not None, "compose() sets the scheme"
    memory = StepMemory(device=w.device, parts=built.model.parts, optimizers=built.optimizers,
                        trace=not plan.config.scheme.compile, index=measure_index(start_step, plan.steps))
    trainer = make_trainer(w, built, batches=batches, policies=policies, memory=memory, checkpoints=checkpoints,
                           start_step=start_step)
    sampler = system_sampler(w)
    if w.rank0:
        run.event("ready", step=start_step, restart=w.env.restart, **clock.ready_event())
    last = loop(w, trainer, policies, checkpoints=checkpoints, batches=batches, start_step=start_step,
                sampler=sampler)
    try:
        checkpoints.close()
    finally:
        heartbeat.close()
    if checkpoints.verified_step != plan.steps:  # the final save failed: the run is not done
        raise RuntimeError(f"the final checkpoint (step {plan.steps}) could not be saved (checkpoint_failed in"
                           f" events.jsonl); the newest verified checkpoint is step {checkpoints.verified_step}")
    batches.close()
    measured = gather_memory(built.prediction, memory, run, rank=w.env.rank, world=w.env.world_size,
                             step=plan.steps)
    if not w.rank0:
        return {}
    return write_summary(run, Finished(
        final_step=plan.steps, last_loss=last.loss if last else None, restarts=w.env.restart,
        world_size=w.env.world_size, scheme=plan.scheme, config_hash=plan.config_hash,
        data_version=built.dataset.version, peak_memory_gib=peak_memory_gib(w.device), memory=measured,
        flops_per_token=policies.metrics.flops_per_token, peak_tflops=policies.metrics.peak_tflops))


def make_trainer(w: Worker, built: Built, *, batches: StepBatches, policies: StepPolicies, memory: StepMemory,
                 checkpoints: CheckpointManager, start_step: int) -> Trainer:
    """The trainer of this rank's parts, with the run's divergence watch and NaN drill."""
    cfg, run = w.plan.config, w.run
    return Trainer(
        model=built.model,
        optimizer=built.optimizers,
        scheduler=built.scheduler,
        batches=batches,
        task=built.task,
        grad_clip=cfg.optim.grad_clip,
        mesh=w.mesh,
        timer=policies.profile.timer,
        around_step=memory.around,
        progress=policies.heartbeat.tick,  # each micro-batch and pipeline action is progress
        watch=divergence_watch(cfg.fault, run, start_step=start_step, comm=checkpoints.comm) if cfg.fault.divergence
        else None,
        nan_drill=NanDrill(run.path if w.rank0 else None),
        event=run.event if w.rank0 else None,
        sync=built.sync,
    )


def system_sampler(w: Worker) -> SystemSampler | None:
    """One sampler per node, in a thread of its own: host and GPU load in system.jsonl."""
    cfg, env = w.plan.config, w.env
    if cfg.train.system_every_s > 0 and env.local_rank == 0:
        return SystemSampler(w.run.path / SYSTEM_LOG, interval_s=cfg.train.system_every_s, rank=env.rank).start()
    return None


def loop(w: Worker, trainer: Trainer, policies: StepPolicies, *, checkpoints: CheckpointManager,
         batches: StepBatches, start_step: int, sampler: SystemSampler | None) -> Any:
    """The steps to the plan's last, rolled back together at a divergence: the last step's
    result. Stops the sampler and closes the step logs however it ends."""
    try:
        while True:
            try:
                return trainer.fit(start_step=start_step, total_steps=w.plan.steps, policies=policies)
            except Rollback as rollback:  # the verdict of every rank: all roll back together
                start_step = roll_back(rollback, w.run, checkpoints, batches, trainer, rank0=w.rank0)
    finally:
        if sampler is not None:
            sampler.stop()
        policies.metrics.close()
        policies.profile.close()


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
        print(f"error: {oom_error(plan, rank=env.rank, device=device)}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
