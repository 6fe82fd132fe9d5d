"""Synchronizing less often (`+sync=`) and compressing DDP's all-reduce (scheme.grad_compression)
at plan time: each mistake is one error line with exit 2 from the torch-free planner, the
plan names the mode, and a sync run is a run of its own (its name)."""

from __future__ import annotations

import pytest

from dtk.config.compose import compose
from dtk.config.identity import identity_hash
from tests.conftest import run_main


@pytest.mark.parametrize("overrides, says", [
    (["+sync=local_sgd", "sync.every=0"], "sync.every=0: expected"),
    (["+sync=diloco", "tasks_per_node=1"], "+sync=diloco with scheme.dp_replicate=1"),
    (["+sync=local_sgd", "+scheme=fsdp"], "+sync=local_sgd with scheme.dp_replicate=1"),
    (["+sync=local_sgd", "+scheme=hybrid", "tasks_per_node=4", "scheme.dp_replicate=2", "scheme.dp_shard=1"],
     "with scheme.tp=2, scheme.pp=1, scheme.cp=1"),
    (["+sync=diloco", "+scheme=cp", "tasks_per_node=4", "scheme.dp_replicate=2", "scheme.dp_shard=1"],
     "with scheme.tp=1, scheme.pp=1, scheme.cp=2"),
    (["+sync=diloco", "sync.outer_momentum=1.0"], "sync.outer_momentum=1.0"),
    (["+sync=diloco", "sync.outer_momentum=0"], "sync.outer_nesterov=true needs"),
    (["+sync=diloco", "sync.outer_lr=0"], "sync.outer_lr=0.0"),
    (["+sync=diloco", "+scheme=ddp", "scheme.grad_compression=bf16"], "exchange no gradients every step"),
    (["+sync=diloco", "checkpoint.memory_every=5"], "checkpoint.memory_every=5"),
    (["+sync=local_sgd", "sync.dtype=bfloat16"], "sync.dtype=bfloat16 with +sync=local_sgd"),
    (["+sync=diloco", "sync.fragments=0"], "sync.fragments=0: expected a number of fragments >= 1"),
    (["+sync=diloco", "sync.every=8", "sync.fragments=3"],
     "sync.fragments=3 does not divide sync.every=8: fragments are synchronized every/fragments steps apart;"
     " try sync.fragments in [1, 2, 4, 8]"),
    (["+scheme=fsdp", "scheme.grad_compression=bf16"], "scheme.grad_compression=bf16 compresses DDP"),
    (["+scheme=ddp", "tasks_per_node=1", "scheme.grad_compression=powersgd"], "one data-parallel rank"),
    (["+scheme=ddp", "scheme.grad_compression=powersgd", "scheme.powersgd_rank=0"], "scheme.powersgd_rank=0"),
])
def test_a_mistake_is_one_error_line(tmp_path, overrides, says):
    proc = run_main("dtk.plan", "tasks_per_node=2", *overrides, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_the_plan_names_the_sync_mode(tmp_path):
    proc = run_main("dtk.plan", "tasks_per_node=2", "+sync=diloco", "sync.every=4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "sync        diloco: replicas average their deltas every 4 steps, outer SGD lr 0.7" in proc.stdout
    bf16 = run_main("dtk.plan", "tasks_per_node=2", "+sync=diloco", "sync.dtype=bfloat16", cwd=tmp_path)
    assert "nesterov, deltas sent in bfloat16" in bf16.stdout, bf16.stderr
    hsdp = run_main("dtk.plan", "tasks_per_node=4", "+scheme=hsdp", "scheme.dp_replicate=2", "+sync=local_sgd",
                    cwd=tmp_path)
    assert "sync        local_sgd: replicas average their parameters every 8 steps" in hsdp.stdout, hsdp.stderr
    plain = run_main("dtk.plan", "tasks_per_node=2", "+scheme=ddp", "scheme.grad_compression=powersgd", cwd=tmp_path)
    assert "sync        every step, gradients compressed: powersgd, rank 2" in plain.stdout, plain.stderr


def test_a_sync_run_is_a_run_of_its_own():
    every_step = identity_hash(compose([]))
    local = identity_hash(compose(["+sync=local_sgd"]))
    diloco = identity_hash(compose(["+sync=diloco"]))
    assert len({every_step, local, diloco}) == 3
    assert identity_hash(compose(["+sync=diloco", "sync.every=4"])) != diloco
    assert identity_hash(compose(["scheme.grad_compression=bf16", "+scheme=ddp"])) != identity_hash(
        compose(["+scheme=ddp"]))


def _job(degrees, *, sync_every: int = 0, sync_bytes: int = 4, **scheme):
    import dataclasses

    from dtk.config.schema import SchemeConfig
    from dtk.plan.cost.exchange import Exchange
    from dtk.plan.cost.memory import Job, precision_for, scheme_config

    s = scheme_config(dict(dataclasses.asdict(SchemeConfig()), **scheme))
    return Job(s, degrees, micro_batch=1, num_micro=1, device="cuda", precision=precision_for(s, "cuda"),
               sync=Exchange(every=sync_every, element_bytes=sync_bytes))


def test_the_planner_counts_the_replicas_exchange_of_each_mode():
    from dtk.config.convert import builtin_transformer
    from dtk.config.schema import ClusterConfig
    from dtk.plan.cost.comm import traffic
    from dtk.plan.cost.steptime import hardware_of, step_time
    from dtk.plan.degrees import Degrees
    from dtk.plan.shape import builtin_shape

    model = compose(["model.dim=1024", "model.num_layers=4", "model.num_heads=8", "model.vocab_size=8192"]).model
    shape = builtin_shape(builtin_transformer(model))
    hw = hardware_of(ClusterConfig(accelerator="h100-80gb", inter_node_gbps=0.05), device="cuda", param_dtype="auto")

    def replicas(job) -> tuple[int, float]:
        axis = next(a for a in traffic(shape, job, 1) if a.axis == "dp_replicate")  # one rank per node
        t = step_time(shape, job, global_batch=8, tasks_per_node=1, hw=hw)
        assert t is not None
        return axis.bytes_per_step, t.axes["dp_replicate"]

    two = Degrees(2, 1, 1, 1)
    ddp_bytes, ddp_s = replicas(_job(two))
    sync_bytes, sync_s = replicas(_job(two, sync_every=8))
    numel = sum(t.numel for t in shape.tensors)
    assert sync_bytes == round(2 * 0.5 * numel * 4 / 8)  # float32 parameters, once per 8 steps
    assert sync_s == pytest.approx(sync_bytes / (0.05e9))  # nothing to hide behind
    assert 0 < sync_s < ddp_s
    bf16_bytes, _ = replicas(_job(two, grad_compression="bf16"))
    assert bf16_bytes * 2 == pytest.approx(ddp_bytes, rel=1e-6)
    powersgd_bytes, _ = replicas(_job(two, grad_compression="powersgd", powersgd_rank=4))
    assert powersgd_bytes < ddp_bytes / 50  # 1024 x 1024 matrices sent as 2 x 1024 x 4 numbers
    bf16_sync_bytes, _ = replicas(_job(two, sync_every=8, sync_bytes=2))
    assert bf16_sync_bytes * 2 == pytest.approx(sync_bytes, rel=1e-6)
    hsdp = Degrees(2, 1, 4, 1)
    hsdp_bytes, _ = replicas(_job(hsdp, data_parallel="fsdp"))
    hsdp_sync_bytes, _ = replicas(_job(hsdp, data_parallel="fsdp", sync_every=4))
    assert hsdp_sync_bytes < hsdp_bytes


@pytest.mark.parametrize("overrides", [["+sync=diloco", "sync.every=4", "checkpoint.every=6"],
                                       ["+sync=local_sgd", "+scheme=hsdp", "scheme.dp_replicate=2"]])
def test_a_sync_runs_overrides_compose_it_again(overrides):
    """What dtk.handover writes as the run's command (dtk.config.overrides): +sync= first."""
    from dtk.config.overrides import repeat_overrides

    cfg = compose(overrides)
    again, why = repeat_overrides(cfg, identity_hash(cfg))
    assert again is not None, why
    assert f"+sync={overrides[0].partition('=')[2]}" in again
    assert compose(again).sync == cfg.sync


def test_a_new_defaulted_sync_key_renames_no_sync_run():
    import dataclasses

    from dtk.config.fields import IDENTITY
    from dtk.config.schema import SyncConfig

    cfg = compose(["+sync=diloco", "sync.every=4"])
    before = identity_hash(cfg)
    later = dataclasses.make_dataclass("SyncConfigNext", [("fragments", int, dataclasses.field(
        default=1, metadata=IDENTITY))], bases=(SyncConfig,))
    cfg.sync = later(**dataclasses.asdict(cfg.sync))
    assert identity_hash(cfg) == before
    cfg.sync.fragments = 2
    assert identity_hash(cfg) != before
