"""A pipeline step holds what its micro-batches in flight need, not one of each per
micro-batch (dtk.parallel.pipeline): on 4 gloo ranks, pp=4 and pp=2 x tp=2 under 1F1B, and
pp=2 x tp=2 under interleaved 1F1B with 2 virtual stages per rank, 8 micro-batches.

- the last stage computes each micro-batch's loss inside the schedule and keeps no logits
  (the schedule's output chunks stay empty);
- a stage's receive buffers (activations from the previous stage, gradients from the next)
  are allocated at their receive and dropped after their backward: the most alive at once
  is bounded by the stages after it (1F1B's warm-up), whatever the micro-batch count, and
  no micro-batch's loss (kept by the schedule to the step's end) keeps its graph, which
  would hold the micro-batch's receive buffer;
- with tp=2 the last stage's logits reach the loss as a DTensor sharded over the
  vocabulary (loss_parallel under a pipeline);
- the losses equal the one-process model's.
"""

from __future__ import annotations

import pytest
import torch

from dtk.config.compose import compose
from dtk.plan.cost.activations import in_flight
from dtk.plan.plan import Plan, make_plan
from multirank import run_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 2
NUM_MICRO = 8
VOCAB = 32
JOB = ["model.num_layers=4", "model.dim=16", "model.num_heads=2", "model.seq_len=8", f"model.vocab_size={VOCAB}",
       "train.global_batch=8", "train.micro_batch=1", "tasks_per_node=4", "optim.warmup_steps=0",
       "+scheme=hybrid", "scheme.dp_shard=1"]
ONE_F_ONE_B = {"pp4": ["scheme.pp=4", "scheme.tp=1", "scheme.pp_schedule=1f1b"],
               "pp2_tp2": ["scheme.pp=2", "scheme.tp=2", "scheme.pp_schedule=1f1b"]}
CASES = {**ONE_F_ONE_B, "pp2_v2_tp2": ["scheme.pp=2", "scheme.tp=2", "scheme.pp_schedule=interleaved_1f1b",
                                       "scheme.pp_virtual_stages=2"]}


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    t = torch.randint(0, VOCAB, (8, 9), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def one_process_losses(plan: Plan) -> list[float]:
    from dtk.models.build import build_model, materialize
    from dtk.train.loss import TokenCrossEntropy
    from dtk.train.optim import build_optimizer

    cfg = plan.config
    model = build_model(cfg.model, device="meta", seed=0)
    materialize([model], model_cfg=cfg.model, device=torch.device("cpu"), seed=0)
    opt = build_optimizer(model.parameters(), optim=cfg.optim, shard_group=None)
    inputs, targets = tokens()
    out = []
    for _ in range(STEPS):
        loss = TokenCrossEntropy()(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def live_buffers(stage) -> int:
    """Receive buffers (activations and gradients) the stage holds now."""
    infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
    return sum(1 for chunk in infos for info in chunk if not info.is_root_arg and info.buffer is not None)


def pipeline_run(plan_json: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dtk.mesh.mesh import build_mesh
    from dtk.models.build import ParallelSpec, build_model, materialize
    from dtk.parallel.parallelize import parallelize
    from dtk.train.loss import TokenCrossEntropy, local_value
    from dtk.train.optim import build_optimizer

    plan = Plan.from_json(plan_json)
    cfg = plan.config
    mesh = build_mesh(plan.degrees, "cpu")
    loss_fn = TokenCrossEntropy()
    seen: list[tuple[bool, int]] = []  # (sharded, local vocabulary) of each logits the loss got

    def recording_loss(logits, targets):
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        seen.append((isinstance(logits, DTensor), local.shape[-1]))
        return loss_fn(logits, targets)

    model = parallelize(
        build_model(cfg.model, device="meta", seed=0), mesh=mesh, scheme=cfg.scheme,
        spec=ParallelSpec.from_config(cfg.model), device=torch.device("cpu"),
        materialize=lambda parts, on: materialize(parts, model_cfg=cfg.model, device=on, seed=0),
        loss_fn=recording_loss, num_microbatches=plan.grad_accum, sharded_logits=True,
    )
    pipe = model.pipeline
    assert pipe is not None
    most = [0]  # the most receive buffers alive at once, over every action of the steps after the first
    outputs = [0]  # the most micro-batches' outputs (on the last stage: logits) a stage holds at once

    def counting(stage, name):
        action = getattr(stage, name)

        def call(*args, **kwargs):
            out = action(*args, **kwargs)
            most[0] = max(most[0], live_buffers(stage))
            outputs[0] = max(outputs[0], len(stage.fwd_cache) + len(stage.output_chunks))
            return out
        setattr(stage, name, call)

    for stage in pipe.stages:
        for name in ("get_fwd_recv_ops", "get_bwd_recv_ops", "forward_one_chunk", "backward_one_chunk"):
            counting(stage, name)
    opt = build_optimizer([p for part in model.parts for p in part.parameters()], optim=cfg.optim, shard_group=None)
    inputs, targets = tokens()
    losses, outputs_kept, after_step, graphs_kept = [], [], [], []
    for step in range(STEPS):
        if step == 1:
            most[0] = outputs[0] = 0
        mine: list[torch.Tensor] = []
        args = (inputs,) if pipe.has_first_stage else ()
        kwargs = {"target": targets, "losses": mine} if pipe.has_last_stage else {}
        pipe.schedule.step(*args, **kwargs)
        outputs_kept.append(sum(len(s.output_chunks) for s in pipe.stages))
        graphs_kept.append(sum(x.grad_fn is not None for x in mine))  # a loss's graph holds its receive buffer
        after_step.append(sum(live_buffers(s) for s in pipe.stages))
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.stack([local_value(x.detach()) for x in mine]).mean() if mine else torch.zeros(())
        dist.all_reduce(loss, group=mesh.pp_group)  # the last stage's, given to every stage
        losses.append(loss.item())
    return {"losses": losses, "most": most[0], "outputs": outputs[0], "outputs_kept": outputs_kept, "after_step": after_step,
            "graphs_kept": graphs_kept,
            "seen": seen, "stage": pipe.stages[0].stage_index, "last": pipe.has_last_stage}


def all_cases(rank: int, world: int, plans: dict[str, str]) -> dict[str, dict]:
    import torch.distributed as dist

    out = {}
    for name, plan_json in plans.items():
        out[name] = pipeline_run(plan_json)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[float], list[dict], Plan]]:
    plans = {name: make_plan(compose([*JOB, *overrides]), cwd="/tmp") for name, overrides in CASES.items()}
    assert {p.grad_accum for p in plans.values()} == {NUM_MICRO}
    ranks = run_on_ranks(all_cases, 4, tmp_path_factory.mktemp("pp_memory"), {k: p.to_json() for k, p in plans.items()})
    return {name: (one_process_losses(plans[name]), [r[name] for r in ranks], plans[name]) for name in CASES}


@pytest.mark.parametrize("name", list(ONE_F_ONE_B))
def test_no_logits_and_no_receive_buffer_outlive_their_micro_batch(runs, name):
    want, ranks, plan = runs[name]
    pp = plan.degrees.pp
    for r in ranks:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
        assert r["outputs_kept"] == [0] * STEPS  # no micro-batch's logits kept to merge
        assert r["after_step"] == [0] * STEPS  # no receive buffer kept between steps
        assert r["graphs_kept"] == [0] * STEPS  # each loss the schedule keeps is detached after its backward
        # 1F1B: stage s runs pp - s forwards before its first backward; each holds its
        # activation buffer and, from the next stage's backward, its gradient buffer.
        assert r["most"] <= 2 * (pp - r["stage"]), r
        assert r["most"] < NUM_MICRO
        # a stage keeps a micro-batch's output until its backward: pp - s under 1F1B, the
        # chunks in flight the planner budgets (dtk.plan.cost.activations.in_flight); the last
        # stage one (its logits: forward, loss, backward, then the next micro-batch)
        planned = in_flight("1f1b", pp=pp, pp_index=r["stage"], num_micro=NUM_MICRO, virtual=1)
        assert r["outputs"] == (1 if r["last"] else planned) == (1 if r["last"] else pp - r["stage"]), r


@pytest.mark.parametrize("name", ["pp2_tp2", "pp2_v2_tp2"])
def test_tensor_parallel_last_stage_computes_the_loss_on_vocabulary_shards(runs, name):
    """1F1B and interleaved 1F1B (2 virtual stages per rank): the loss on vocabulary shards,
    no logits kept, no receive buffer between steps, the one-process losses."""
    want, ranks, _ = runs[name]
    for r in ranks:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
    last = [r for r in ranks if r["last"]]
    assert len(last) == 2  # the two tp ranks of the last stage
    for r in last:
        # the first step also runs the loss once to learn the backward's shapes
        assert len(r["seen"]) >= STEPS * NUM_MICRO
        assert set(r["seen"]) == {(True, VOCAB // 2)}
    for r in ranks:
        assert r["outputs_kept"] == [0] * STEPS and r["after_step"] == [0] * STEPS
        assert r["graphs_kept"] == [0] * STEPS  # a DTensor loss too, and under the interleaved schedule
