"""Run planned jobs' models for real on several gloo processes and measure their memory.

`run_ranks(cases, world)` starts `world` processes; each builds every case's model exactly
as a worker does (mesh, meta build, parallelize, materialize, optimizer), runs two
training steps on a fixed batch, and reports from the second (buffers that a pipeline
allocates once exist by then): the bytes of its parameters, gradients (after backward)
and optimizer state (after the step), and the peak of live activation bytes during the
step (dtk.train.measure). Returns {case: [per-rank dict]}.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtk.mesh.mesh import build_mesh
from dtk.models.build import ParallelSpec, build_model, materialize
from dtk.parallel.parallelize import parallelize
from dtk.plan.plan import Plan
from dtk.train.loss import TokenCrossEntropy
from dtk.train.measure import LiveActivations, state_bytes
from dtk.train.optim import build_optimizer

cross_entropy = TokenCrossEntropy()  # the loss a worker trains with


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(plan: Plan, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's samples of one step (fixed, seeded by the rank)."""
    model = plan.config.model
    g = torch.Generator().manual_seed(100 + dp_rank)
    local = plan.global_batch // plan.degrees.dp
    tokens = torch.randint(0, model.vocab_size, (local, model.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def measure_case(plan: Plan, device: torch.device) -> dict[str, int]:
    cfg = plan.config
    scheme = cfg.scheme
    mesh = build_mesh(plan.degrees, device.type)
    model = parallelize(
        build_model(cfg.model, device="meta", seed=0), mesh=mesh, scheme=scheme,
        spec=ParallelSpec.from_config(cfg.model), device=device,
        materialize=lambda parts, on: materialize(parts, model_cfg=cfg.model, device=on, seed=0),
        loss_fn=cross_entropy, num_microbatches=plan.grad_accum, sharded_logits=False,
    )
    shard_group = mesh.dp_group if scheme.shard_optimizer else None
    optimizers = [build_optimizer(p.parameters(), optim=cfg.optim, shard_group=shard_group) for p in model.parts]
    inputs, targets = batch(plan, mesh.dp_rank)
    forward_backward(model, plan, inputs, targets)  # warm-up: buffers allocated once, optimizer state
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    existing = [t for part in model.parts for t in part.parameters()] + [inputs, targets]
    tracker = LiveActivations(exclude=existing)
    with tracker:
        forward_backward(model, plan, inputs, targets)
    grads = state_bytes(model.parts, [])["grads"]
    for opt in optimizers:
        opt.step()
    states = state_bytes(model.parts, optimizers)
    return {"params": states["params"], "grads": grads, "optimizer": states["optimizer"],
            "activations_peak": tracker.peak}


def forward_backward(model, plan: Plan, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """One step's forward and backward, as dtk.train.trainer runs it (fp32 on the CPU: no autocast)."""
    if model.pipeline is not None:
        pipe = model.pipeline
        args = (inputs,) if pipe.has_first_stage else ()
        kwargs = {"target": targets, "losses": []} if pipe.has_last_stage else {}
        pipe.schedule.step(*args, **kwargs)
        return
    micro = plan.micro_batch
    for i in range(plan.grad_accum):
        x, y = inputs[i * micro : (i + 1) * micro], targets[i * micro : (i + 1) * micro]
        logits = model.parts[0](x)
        (cross_entropy(logits, y) / plan.grad_accum).backward()
        del logits


def _worker(rank: int, world: int, port: int, cases: dict[str, str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for name, plan_json in cases.items():
            results[name] = measure_case(Plan.from_json(plan_json), torch.device("cpu"))
            dist.barrier()
    finally:
        Path(out, f"rank_{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def run_ranks(cases: dict[str, Plan], world: int) -> dict[str, list[dict[str, int]]]:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, free_port(), {k: p.to_json() for k, p in cases.items()}, out),
                           nprocs=world, start_method="spawn")
        per_rank = [json.loads(Path(out, f"rank_{r}.json").read_text()) for r in range(world)]
    return {name: [per_rank[r][name] for r in range(world)] for name in cases}
