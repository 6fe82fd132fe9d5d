"""The planner's side of a weak link between nodes: the memory budget counts what exchanging
less keeps (held against the tensors the runtime builds), and the plan advises synchronizing
less often or compressing when the data-parallel exchange dominates the predicted step."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dtk.config.choices import GradCompression, SyncMode
from dtk.config.schema import SchemeConfig, SyncConfig, TransformerConfig
from dtk.plan.cost.exchange import Exchange
from dtk.plan.cost.memory import Job, precision_for, rank_bytes, scheme_config
from dtk.plan.degrees import Degrees
from dtk.plan.shape import builtin_shape
from tests.conftest import run_main

SMALL = dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, seq_len=16)
"""Its 64 x 64 and 64 x 176 matrices shrink under PowerSGD at rank 2; its norms are sent whole."""


def _job(degrees: Degrees, sync: SyncConfig | None = None, **scheme) -> Job:
    s = scheme_config(dict(dataclasses.asdict(SchemeConfig()), **scheme))
    return Job(s, degrees, micro_batch=1, num_micro=1, device="cpu", precision=precision_for(s, "cpu"),
               sync=Exchange.of(sync))


def _planned(job: Job) -> dict[str, int]:
    return rank_bytes(builtin_shape(TransformerConfig(**SMALL)), job, 0).detail


def _kept_by_runtime(rank: int, world: int, kind: str) -> dict[str, int]:
    """Bytes of the state tensors dtk.train.sync or dtk.parallel.compression build, on one process."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dtk.models.transformer import build
    from dtk.parallel.compression import POWERSGD_WARMUP, apply_compression
    from dtk.train.sync import Synchronizer

    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    torch.manual_seed(0)
    model = build(**SMALL)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, SMALL["seq_len"]))
    if kind == "powersgd":
        ddp = DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
        state = apply_compression(ddp, compression=GradCompression.powersgd, powersgd_rank=2, group=None)
        assert state is not None
        for _ in range(POWERSGD_WARMUP + 2):  # past the uncompressed warm-up
            ddp(tokens).float().square().mean().backward()
            ddp.zero_grad(set_to_none=True)
        s = state.state
        return {"powersgd_error": size(s.error_dict.values()),
                "powersgd_pq": size(s.p_memory_dict.values()) + size(s.q_memory_dict.values())}
    sync = Synchronizer(sync=SyncConfig(mode=SyncMode(kind), every=1), model=model, group=dist.group.WORLD,
                        replicas=world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(tokens).float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync.after_step(1)  # diloco's outer SGD makes its momentum buffer here
    assert sync.syncs == 1
    momentum = [v for st in sync.outer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"sync_anchor": size(sync.anchor.parameters()), "sync_outer_momentum": size(momentum)}


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["local_sgd", "diloco", "powersgd"])
def test_the_budget_counts_the_state_tensors_the_runtime_builds(tmp_path, kind):
    from multirank import run_on_ranks

    measured = run_on_ranks(_kept_by_runtime, 1, tmp_path, kind)[0]
    two = Degrees(2, 1, 1, 1)  # a rank's own share: the same on 1 process as on any number of replicas
    if kind == "powersgd":
        planned = _planned(_job(two, data_parallel="ddp", grad_compression="powersgd"))
    else:
        planned = _planned(_job(two, SyncConfig(mode=SyncMode(kind), every=8)))
    assert measured["powersgd_error" if kind == "powersgd" else "sync_anchor"] > 0
    for key, value in measured.items():
        assert planned.get(key, 0) == value, (key, planned, measured)


def test_an_hsdp_replica_keeps_its_shard_and_the_sync_copies_go_to_the_checkpoint():
    sync = SyncConfig(mode=SyncMode.diloco, every=8)
    plain = rank_bytes(builtin_shape(TransformerConfig(**SMALL)), _job(Degrees(2, 1, 1, 1), sync), 0)
    hsdp = rank_bytes(builtin_shape(TransformerConfig(**SMALL)),
                      _job(Degrees(2, 1, 4, 1), sync, data_parallel="fsdp"), 0)
    assert plain.detail["sync_anchor"] == plain.params  # a copy of the replica's parameters
    assert hsdp.detail["sync_anchor"] == hsdp.params < plain.params  # its FSDP shard
    assert hsdp.detail["sync_outer_momentum"] == hsdp.params
    no_momentum = _planned(_job(Degrees(2, 1, 1, 1), dataclasses.replace(sync, outer_momentum=0.0,
                                                                         outer_nesterov=False)))
    assert "sync_outer_momentum" not in no_momentum
    # streaming: a synchronization copies one fragment, the anchor and momentum stay whole
    from dtk.plan.cost.exchange import exchange_state
    from dtk.plan.layout import rank_layout

    def copies(fragments: int) -> dict[str, int]:
        job = _job(Degrees(2, 1, 1, 1), dataclasses.replace(sync, fragments=fragments))
        layout = rank_layout(builtin_shape(TransformerConfig(**SMALL)), job.scheme, job.degrees, 0, ())
        return exchange_state(job, layout, freed=0, param_bytes=4, grad_bytes=4)  # nothing freed: the copies whole

    whole, streamed = copies(1), copies(2)
    assert whole["sync_exchange"] == 3 * plain.params  # deltas' mean, outer gradient and Nesterov's temporary
    assert streamed["sync_anchor"] == whole["sync_anchor"] and whole["sync_exchange"] / 2 <= streamed["sync_exchange"]
    assert streamed["sync_exchange"] < whole["sync_exchange"]
    every_step = rank_bytes(builtin_shape(TransformerConfig(**SMALL)), _job(Degrees(2, 1, 1, 1)), 0)
    assert not {k for k in every_step.detail if k.startswith(("sync_", "powersgd_"))}
    staged = every_step.detail["checkpoint_staging"] + 2 * plain.params  # anchor and momentum saved too
    assert plain.detail["checkpoint_staging"] == staged


WEAK = ["cluster=slurm", "nodes=8", "tasks_per_node=8", "cluster.gpus_per_node=8", "cluster.accelerator=h100-80gb",
        "model.dim=2048", "model.num_layers=20", "model.num_heads=16", "model.seq_len=2048",
        "model.vocab_size=32000", "train.global_batch=512"]
"""A 1.1B-parameter model on 8 nodes of 8 H100s (DDP, the default)."""
ONE_GBIT = "cluster.inter_node_gbps=0.125"  # the key is in GB/s: 1 Gbit/s per node
INFINIBAND = "cluster.inter_node_gbps=50"  # 400 Gbit/s


def _plan_json(tmp_path, *overrides: str) -> dict:
    proc = run_main("dtk.plan", *WEAK, *overrides, "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_1gbit_link_gets_the_advice_to_synchronize_less_or_compress(tmp_path):
    from dtk.plan.sync import EXCHANGE_DOMINATES, EXCHANGE_TARGET

    out = _plan_json(tmp_path, ONE_GBIT)
    weak = out["weak_link"]
    assert weak["exchange_share"] >= EXCHANGE_DOMINATES
    kinds = {o["kind"]: o for o in weak["options"]}
    assert set(kinds) == {"diloco", "bf16", "powersgd"}
    diloco = kinds["diloco"]
    assert diloco["overrides"] == ["+sync=diloco", f"sync.every={diloco['every']}"]
    assert diloco["exchange_share"] <= EXCHANGE_TARGET < weak["exchange_share"]
    assert diloco["predicted_step_s"] < out["predicted_step_s"] / 10
    assert diloco["extra_bytes"] > 0  # the anchor and the outer momentum
    assert kinds["bf16"]["predicted_step_s"] < out["predicted_step_s"]
    assert "docs/benchmarks.md" in weak["measured"] and "within 2%" in diloco["quality"]
    text = run_main("dtk.plan", *WEAK, ONE_GBIT, cwd=tmp_path).stdout
    assert f"weak link   +sync=diloco sync.every={diloco['every']}: exchange" in text
    assert "weak link   scheme.grad_compression=bf16 (+scheme=ddp first, if the command names no scheme): exchange" in text
    assert "quality: measured at sync.every=8" in text


def test_an_option_that_does_not_fit_says_so(tmp_path):
    out = _plan_json(tmp_path, ONE_GBIT)
    diloco = next(o for o in out["weak_link"]["options"] if o["kind"] == "diloco")
    tight = (out["per_device_bytes"]["total"] + diloco["extra_bytes"] // 2) / 1e9  # room for half of what it adds
    text = run_main("dtk.plan", *WEAK, ONE_GBIT, f"cluster.device_memory_gb={tight}", cwd=tmp_path).stdout
    line = next(line for line in text.splitlines() if line.startswith("weak link   +sync=diloco"))
    assert "which does NOT fit" in line
    roomy = run_main("dtk.plan", *WEAK, ONE_GBIT, cwd=tmp_path).stdout
    assert "does NOT fit" not in roomy


@pytest.mark.slow
def test_a_fast_link_and_a_sync_run_get_no_advice(tmp_path):
    fast = _plan_json(tmp_path, INFINIBAND)
    assert fast["weak_link"]["options"] == [] and fast["weak_link"]["exchange_share"] < 0.5
    text = run_main("dtk.plan", *WEAK, INFINIBAND, cwd=tmp_path).stdout
    assert "no advice to exchange less" in text and "weak link" not in text
    synced = _plan_json(tmp_path, ONE_GBIT, "+sync=diloco", "sync.every=64")
    assert synced["weak_link"]["options"] == [] and synced["weak_link"]["exchange_share"] > 0
    text = run_main("dtk.plan", *WEAK, ONE_GBIT, "+sync=diloco", "sync.every=64", cwd=tmp_path).stdout
    assert "under +sync=diloco, every 64 steps" in text and "weak link" not in text


def test_one_device_has_no_exchange_line(tmp_path):
    proc = run_main("dtk.plan", "cluster.accelerator=h100-80gb", "dist.device=cuda", "tasks_per_node=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert " s per step (compute" in proc.stdout and "exchange    " not in proc.stdout  # predicted, no exchange


def test_a_scheme_without_replicas_is_told_why_sync_is_not_offered(tmp_path):
    out = _plan_json(tmp_path, ONE_GBIT, "+scheme=fsdp")
    weak = out["weak_link"]
    assert weak["exchange_share"] >= 0.5 and weak["options"] == []
    assert "+sync=diloco with scheme.dp_replicate=1" in weak["refused"]


def test_plan_md_names_the_mode_and_the_advice(tmp_path):
    from dtk.config.compose import compose
    from dtk.plan.cost.handout import plan_markdown
    from dtk.plan.cost.inputs import context
    from dtk.plan.cost.report import memory_plan
    from dtk.plan.plan import make_plan

    def markdown(*overrides: str) -> str:
        cfg = compose([*WEAK, *overrides])
        plan = make_plan(cfg, cwd=tmp_path)
        return plan_markdown(plan, memory_plan(context(cfg, plan), plan))

    advised = markdown(ONE_GBIT)
    assert "- the job as given: +sync=diloco sync.every=" in advised
    synced = markdown(ONE_GBIT, "+sync=diloco", "sync.every=64", "sync.dtype=bfloat16")
    assert "diloco: replicas average their deltas every 64 steps" in synced and "deltas sent in bfloat16" in synced
    assert "+sync: parameter all-reduce every 64 steps" in synced
    compressed = markdown(ONE_GBIT, "+scheme=ddp", "scheme.grad_compression=bf16")
    assert "every step, gradients compressed: bf16" in compressed
    assert "DDP gradient all-reduce in bfloat16" in compressed


def test_sync_periods_hold_the_synchronizing_step_and_leave_out_the_start_up():
    from dtk.report.planned import sync_periods

    # every 4th step synchronizes (0.9 s), the others 0.1 s; step 1 carries the start-up
    times = {s: (0.9 if s % 4 == 0 else 0.1) for s in range(1, 15)} | {1: 5.0}
    p = sync_periods({s: {"step_time_s": t} for s, t in times.items()}, 4)
    assert p is not None
    assert (p["periods"], p["first_step"], p["last_step"]) == (2, 5, 12)  # 13-14: not a whole period
    assert p["mean_s"] == pytest.approx((0.9 + 3 * 0.1) / 4)
    assert (p["sync_step_s"], p["between_s"]) == (0.9, 0.1)
    assert sync_periods({s: {"step_time_s": 0.1} for s in range(1, 4)}, 4) is None
    # sync.fragments=2: a fragment synchronizes every 2 steps, the period is still 4 steps
    streamed = sync_periods({s: {"step_time_s": 0.5 if s % 2 == 0 else 0.1} for s in range(1, 13)}, 4, 2)
    assert streamed is not None and (streamed["sync_step_s"], streamed["between_s"]) == (0.5, 0.1)
    assert streamed["mean_s"] == pytest.approx(0.3)


@pytest.mark.slow
def test_report_holds_a_real_sync_run_against_the_plans_amortised_step(tmp_path):
    """A real 2-rank diloco run on the local cluster; the plan's prediction asked as if the
    device were a GPU (the CPU has no step-time model), as docs/benchmarks.md does."""
    from dtk.config.compose import compose
    from dtk.plan.plan import Plan
    from dtk.report.numbers import run_numbers
    from dtk.report.planned import planned, planned_lines
    from dtk.report.runs import load_run
    from tests.conftest import dtk

    job = ["tasks_per_node=2", "+sync=diloco", "sync.every=4", "train.steps=14", "train.global_batch=8",
           "checkpoint.every=100", "run.name=r"]
    proc = dtk("dtk.submit", *job, f"run.root={tmp_path}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = load_run(tmp_path / "r")
    p = planned(run, run_numbers(run))
    sync = p["step"]["sync"]
    assert (sync["every"], sync["periods"], sync["first_step"], sync["last_step"]) == (4, 2, 5, 12)
    times = {s: float(r["step_time_s"]) for s, r in run.latest.items()}
    assert sync["mean_s"] == pytest.approx(sum(times[s] for s in range(5, 13)) / 8, rel=1e-4)
    assert sync["sync_step_s"] == pytest.approx((times[8] + times[12]) / 2, rel=1e-4)  # the median of two
    assert p["step"]["predicted_s"] is None  # the CPU: no step-time model
    lines = planned_lines(p)
    assert any("sync every 4 steps: the synchronizing step" in line and "steps 5-12" in line for line in lines)

    plan = Plan.from_json((run.path / "plan.json").read_text())  # the same job planned as if on a GPU
    gpu = compose([*job[:5], "dist.device=cuda", "cluster.peak_tflops=0.05"])
    (run.path / "plan.json").write_text(dataclasses.replace(plan, config=gpu).to_json())
    run = load_run(run.path)
    p = planned(run, run_numbers(run))
    assert p["step"]["predicted_s"] > 0
    assert p["step"]["measured_s"] == sync["mean_s"]  # not the median, which leaves the synchronizing steps out
    assert p["step"]["ratio"] == pytest.approx(sync["mean_s"] / p["step"]["predicted_s"], rel=1e-2)
    step = planned_lines(p)[0]
    assert "measured (mean over whole sync periods) against" in step
    out = dtk("dtk.report", str(run.path), "--no-plots", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "sync every 4 steps: the synchronizing step" in out.stdout


@pytest.mark.parametrize("overrides, says", [
    (["+sync=diloco", "sync.every=0"], "sync.every=0: expected optimizer steps between synchronizations >= 1"),
    (["+sync=diloco", "tasks_per_node=1"], "+sync=diloco with scheme.dp_replicate=1: there is one data-parallel"),
    (["+sync=local_sgd", "+scheme=fsdp"], "+sync=local_sgd with scheme.dp_replicate=1"),
    (["+sync=diloco", "+scheme=hsdp", "tasks_per_node=4", "scheme.dp_replicate=1"],
     "+sync=diloco with scheme.dp_replicate=1"),
    (["sync.outer_lr=0.5"], "sync.outer_lr=0.5: sync.* keys need a sync chosen first"),
])
@pytest.mark.parametrize("command", ["dtk.plan", "dtk.submit"])
def test_a_sync_without_replicas_is_one_error_line_from_plan_and_submit(tmp_path, command, overrides, says):
    proc = run_main(command, "tasks_per_node=2", *overrides, f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_a_sync_checkpoint_holds_each_replica_and_the_anchor(tmp_path):
    def planned(*overrides: str) -> dict:
        proc = run_main("dtk.plan", "tasks_per_node=2", *overrides, "--json", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    every_step = planned("+scheme=ddp")
    params = every_step["params"]
    diloco = planned("+sync=diloco")
    local_sgd = planned("+sync=local_sgd")
    assert diloco["checkpoint_bytes"] == 2 * every_step["checkpoint_bytes"] + 2 * 4 * params  # anchor + momentum
    assert local_sgd["checkpoint_bytes"] == 2 * every_step["checkpoint_bytes"] + 4 * params  # anchor
