"""What runs after every step (dtk.train.policies), made for this rank: global rank 0
writes, every rank takes part in the collective ones."""

from __future__ import annotations

import torch

from dtk.checkpoint.manager import CheckpointManager
from dtk.common.rundir import EVAL_LOG, TRACKER_STATE, RunDir
from dtk.config.choices import Tracker, chosen_trackers
from dtk.config.convert import to_dict
from dtk.parallel.precision import resolve_dtype
from dtk.plan.plan import Plan
from dtk.train.evaluate import Evaluator
from dtk.train.flops import flops_per_token, peak_tflops
from dtk.train.metrics import MetricsLog
from dtk.train.policies import STOP_VOTE_SHARE, AgreedStop, Heartbeat, ResumedEvent, StepPolicies
from dtk.train.profile import StepProfiler
from dtk.train.tensorboard import TensorBoardLog
from dtk.train.tracker import TrackerSink
from dtk.train.tracker_clients import clients
from dtk.worker.env import WorkerEnv
from dtk.worker.signals import stop_flag, vote_group
from dtk.worker.wiring import Built, Worker


def tracker_sinks(plan: Plan, env: WorkerEnv, run: RunDir) -> tuple[TrackerSink, ...]:
    """Rank 0's MLflow and W&B sinks (dtk.train.tracker), each logging from a thread of its own."""
    cfg = plan.config
    made = clients(chosen_trackers(cfg.train.tracker, tensorboard=False), mlflow_uri=cfg.train.mlflow_uri,
                   run_dir=run.path, config=to_dict(cfg))
    return tuple(TrackerSink(c, state=run.path / TRACKER_STATE, metrics=run.metrics, event=run.event,
                             total_steps=plan.steps, job_id=env.job_id) for c in made)


def metrics_log(w: Worker, *, samples_per_epoch: int) -> MetricsLog:
    """metrics.jsonl (rank 0 writes it) and the trackers it feeds."""
    plan, cfg, env, run, device = w.plan, w.plan.config, w.env, w.run, w.device
    assert cfg.scheme is not None, "compose() sets the scheme"
    trackers = chosen_trackers(cfg.train.tracker, tensorboard=cfg.train.tensorboard)
    return MetricsLog(
        run.metrics if w.rank0 else None,
        world_size=env.world_size,
        restart=env.restart,
        global_batch=plan.global_batch,
        tokens_per_step=plan.global_batch * (cfg.model.seq_len or 0),
        total_steps=plan.steps,
        log_every=cfg.train.log_every,
        samples_per_epoch=samples_per_epoch,
        # Rank 0 writes the records: only it counts the model's FLOPs (a user model: one traced step on meta).
        flops_per_token=flops_per_token(cfg.model) if w.rank0 else None,
        peak_tflops=peak_tflops(
            override=cfg.cluster.peak_tflops, accelerator=cfg.cluster.accelerator, device=device,
            dtype=resolve_dtype(cfg.scheme.param_dtype, device, auto=torch.bfloat16, key="scheme.param_dtype"),
        )[0],
        tensorboard=TensorBoardLog(run.path) if w.rank0 and Tracker.tensorboard in trackers else None,
        trackers=tracker_sinks(plan, env, run) if w.rank0 else (),
    )


def agreed_stop(w: Worker, checkpoints: CheckpointManager) -> AgreedStop:
    """The stop every rank agrees on, by a vote on gloo at each step."""
    stop = stop_flag()  # installed when the process started (dtk/worker/__main__.py)
    votes = vote_group()  # host tensors on gloo: a stop vote never waits for the GPU
    return AgreedStop(
        agreed=lambda seconds: stop.vote(votes, seconds),
        checkpoints=checkpoints,
        total_steps=w.plan.steps,
        run=w.run if w.rank0 else None,
        restart=w.env.restart,
        budget_s=STOP_VOTE_SHARE * w.plan.config.fault.signal_lead_floor_s,
    )


def evaluator(w: Worker, built: Built, *, heartbeat: Heartbeat, stop: AgreedStop) -> Evaluator:
    """The validation loss every train.eval_every steps."""
    plan, cfg = w.plan, w.plan.config

    def eval_batch_stop() -> bool:
        heartbeat.tick()  # each validation batch is progress: a long evaluation is not a hang
        return stop.poll()
    return Evaluator(
        model=built.model.parts[0],  # the plan rejects eval_every with a pipeline: the one part is the model
        dataset=built.val_dataset,
        task=built.task,
        every=cfg.train.eval_every,
        total_steps=plan.steps,
        max_samples=cfg.data.eval_samples,
        global_batch=plan.global_batch,
        micro_batch=plan.micro_batch,
        mesh=w.mesh,
        device=w.device,
        log=w.run.path / EVAL_LOG if w.rank0 else None,
        # Collective, before every validation batch: a long evaluation ends at a stop signal.
        stop_requested=eval_batch_stop,
        autocast_dtype=built.model.autocast_dtype,  # the training forward's, so val_loss compares with loss
    )


def step_policies(w: Worker, built: Built, *, checkpoints: CheckpointManager, heartbeat: Heartbeat,
                  start_step: int) -> StepPolicies:
    """Every policy of dtk.train.policies for this rank, from the start at `start_step`."""
    plan, cfg, env, run = w.plan, w.plan.config, w.env, w.run
    stop = agreed_stop(w, checkpoints)
    metrics = metrics_log(w, samples_per_epoch=len(built.dataset))
    return StepPolicies(
        metrics=metrics,
        heartbeat=heartbeat,
        resumed=ResumedEvent(
            run if w.rank0 else None,
            start_step=start_step,
            restart=env.restart,
            world_size=env.world_size,
            recovery_from=env.recovery_from,
            job_id=env.job_id,
        ),
        evaluation=evaluator(w, built, heartbeat=heartbeat, stop=stop),
        checkpoint=checkpoints,
        stop=stop,
        profile=StepProfiler(
            device=w.device,
            enabled=cfg.train.profile,
            straggler_factor=cfg.fault.straggler_factor,
            run=run if w.rank0 else None,
            rank=env.rank,
            log_every=cfg.train.log_every,
            total_steps=plan.steps,
            metrics=metrics,
            saving=lambda: checkpoints.saving,
            checkpointed=lambda: checkpoints.last_kept,
        ),
    )
