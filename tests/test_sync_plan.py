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
     "with scheme.tp=2, scheme.pp=1"),
    (["+sync=diloco", "sync.outer_momentum=1.0"], "sync.outer_momentum=1.0"),
    (["+sync=diloco", "sync.outer_momentum=0"], "sync.outer_nesterov=true needs"),
    (["+sync=diloco", "sync.outer_lr=0"], "sync.outer_lr=0.0"),
    (["+sync=diloco", "+scheme=ddp", "scheme.grad_compression=bf16"], "exchange no gradients every step"),
    (["+sync=diloco", "checkpoint.memory_every=5"], "checkpoint.memory_every=5"),
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
