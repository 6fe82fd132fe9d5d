"""Pipeline parallel with FSDP inside each stage (pp=2 x dp_shard=2 on 4 gloo ranks): a
stage's parameters are all-gathered once per pipeline step, not once per micro-batch, and
stay gathered until the step's last backward (dtk.plan.layout.reshards_after_forward, the
rule the planner's memory and traffic figures follow); the losses are the one-process
model's.

The all-gathers are counted by wrapping FSDP's own `foreach_all_gather` (one call per unit
that unshards); steps after the first are counted, since the schedule's first step also runs
a forward and backward to learn its shapes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from dtk.config.compose import compose
from dtk.plan.cost.comm import fsdp_collectives
from dtk.plan.plan import Plan, make_plan
from multirank import run_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 3
NUM_MICRO = 4
JOB = ["model.num_layers=4", "model.dim=16", "model.num_heads=2", "model.seq_len=8", "model.vocab_size=32",
       "train.global_batch=8", "train.micro_batch=1", "tasks_per_node=4", "optim.warmup_steps=0",
       "+scheme=hybrid", "scheme.pp=2", "scheme.dp_shard=2", "scheme.tp=1"]


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, 32, (8, 9), generator=g)
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


COUNTS = {"all_gather": 0, "reduce_scatter": 0}
"""FSDP's collectives in this process so far (`counting`)."""


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """Count every unit's all-gather and reduce-scatter: FSDP's own foreach_all_gather and
    foreach_reduce, as its parameter groups call them."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    gather, reduce = group.foreach_all_gather, group.foreach_reduce

    def counted(name: str, fn):
        def call(*args, **kwargs):
            COUNTS[name] += 1
            return fn(*args, **kwargs)
        return call

    group.foreach_all_gather, group.foreach_reduce = counted("all_gather", gather), counted("reduce_scatter", reduce)
    try:
        yield
    finally:
        group.foreach_all_gather, group.foreach_reduce = gather, reduce


def pipeline_step_counts(plan_json: str) -> dict:
    """Build the planned job's model as a worker does and run STEPS pipeline steps: each
    step's collectives, whether every unit of a stage is still gathered after each of its
    forwards, whether all are sharded after the step, and the global loss."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from dtk.mesh.mesh import build_mesh
    from dtk.models.build import ParallelSpec, build_model, materialize
    from dtk.parallel.parallelize import parallelize
    from dtk.train.loss import TokenCrossEntropy
    from dtk.train.optim import build_optimizer

    plan = Plan.from_json(plan_json)
    cfg = plan.config
    counts = COUNTS
    mesh = build_mesh(plan.degrees, "cpu")
    model = parallelize(
        build_model(cfg.model, device="meta", seed=0), mesh=mesh, scheme=cfg.scheme,
        spec=ParallelSpec.from_config(cfg.model), device=torch.device("cpu"),
        materialize=lambda parts, on: materialize(parts, model_cfg=cfg.model, device=on, seed=0),
        loss_fn=TokenCrossEntropy(), num_microbatches=plan.grad_accum, sharded_logits=False,
    )

    def groups(module):  # the FSDP units' parameter groups (a stage's root may have no parameters of its own)
        states = (m._get_fsdp_state() for m in module.modules() if isinstance(m, FSDPModule))
        return [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]

    units = [g for part in model.parts for g in groups(part)]
    # after each micro-batch's forward through a stage: is every unit of the stage still gathered?
    unsharded_after: list[bool] = []

    def record(stage, *_):
        unsharded_after.append(all(g.is_unsharded for g in groups(stage)))

    params = []
    for part in model.parts:
        part.register_forward_hook(record)
        params += list(part.parameters())
    opt = build_optimizer(params, optim=cfg.optim, shard_group=None)
    inputs, targets = tokens()
    local = inputs.shape[0] // plan.degrees.dp
    dp = mesh.dp_rank
    pipe = model.pipeline
    per_step, losses = [], []
    for _ in range(STEPS):
        before = dict(counts)
        unsharded_after.clear()
        mine: list[torch.Tensor] = []
        args = (inputs[dp * local:(dp + 1) * local],) if pipe.has_first_stage else ()
        kwargs = {"target": targets[dp * local:(dp + 1) * local], "losses": mine} if pipe.has_last_stage else {}
        pipe.schedule.step(*args, **kwargs)
        per_step.append({k: counts[k] - before[k] for k in counts} | {
            "kept": list(unsharded_after), "sharded_after_step": not any(g.is_unsharded for g in units)})
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.stack(mine).mean() if mine else torch.zeros(())
        # the global loss: the mean over the last stage's data-parallel ranks (the others add 0)
        dist.all_reduce(loss)
        losses.append(loss.item() / plan.degrees.dp)
    return {"units": len(units), "steps": per_step, "losses": losses, "stages": len(model.parts)}


def plan_for(*overrides: str) -> Plan:
    return make_plan(compose([*JOB, *overrides]), cwd="/tmp")


def all_cases(rank: int, world: int, plans: dict[str, str]) -> dict[str, dict]:
    import torch.distributed as dist

    out = {}
    with counting():
        for name, plan_json in plans.items():
            out[name] = pipeline_step_counts(plan_json)
            dist.barrier()
    return out


CASES = {
    "1f1b": ["scheme.pp_schedule=1f1b"],
    "gpipe": ["scheme.pp_schedule=gpipe"],
    "interleaved": ["scheme.pp_schedule=interleaved_1f1b", "scheme.pp_virtual_stages=2"],
    "1f1b, always": ["scheme.pp_schedule=1f1b", "scheme.reshard_after_forward=true"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[float], list[dict]]]:
    """Each case's one-process losses and every rank's counts, all cases in one start of the ranks."""
    plans = {name: plan_for(*overrides) for name, overrides in CASES.items()}
    assert {p.grad_accum for p in plans.values()} == {NUM_MICRO}
    ranks = run_on_ranks(all_cases, 4, tmp_path_factory.mktemp("pp_fsdp"), {k: p.to_json() for k, p in plans.items()})
    return {name: (one_process_losses(plans[name]), [r[name] for r in ranks]) for name in CASES}


def planned(name: str) -> tuple[int, int]:
    """The budget's all-gathers and reduce-scatters of each unit per step (dtk.plan.cost.comm)."""
    plan = plan_for(*CASES[name])
    gathers, reduces, _ = fsdp_collectives(plan.config.scheme, plan.degrees, plan.grad_accum)
    return gathers, reduces


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_stage_parameters_are_gathered_once_per_pipeline_step(runs, schedule):
    want, ranks = runs[schedule]
    assert planned(schedule) == (1, 1)
    for r in ranks:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
        for step in r["steps"][1:]:
            # one all-gather and one reduce-scatter per unit and step, whatever the micro-batches
            assert (step["all_gather"], step["reduce_scatter"]) == (r["units"], r["units"]), step
            assert step["kept"] == [True] * (NUM_MICRO * r["stages"]), step  # gathered through the step
            assert step["sharded_after_step"]


def test_reshard_after_forward_true_reshards_every_micro_batch(runs):
    """The override: each micro-batch's forward frees what it gathered; backward gathers again."""
    want, ranks = runs["1f1b, always"]
    gathers, reduces = planned("1f1b, always")  # the budget's bound: each micro-batch's forward and backward
    for r in ranks:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
        for step in r["steps"][1:]:
            assert 2 * r["units"] < step["all_gather"] <= gathers * r["units"], step
            assert step["reduce_scatter"] == reduces * r["units"], step
            assert step["kept"] == [False] * NUM_MICRO, step
            assert step["sharded_after_step"]
