"""A checkpoint load that fails on one rank only (injected) stops every rank with the same
cause, on 2 real gloo ranks: nothing is rejected, nothing deleted, no rank falls through to
an older checkpoint. Then the same checkpoint loads on both. One spawn runs it all."""

from __future__ import annotations

import errno
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtk.common.storage import checkpoint_steps, checkpoints_of
from multirank import run_on_ranks

pytestmark = pytest.mark.dist
WORLD = 2


def _manager(run, seed: int):
    from dtk.checkpoint.manager import CheckpointManager
    from dtk.config.schema import CheckpointConfig
    from dtk.mesh.mesh import build_mesh
    from dtk.plan.degrees import Degrees

    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    mesh = build_mesh(Degrees(dp_replicate=WORLD, pp=1, dp_shard=1, tp=1), "cpu")
    manager = CheckpointManager(run, checkpoint=CheckpointConfig(every=1, keep=5, async_save=False),
                                parts=[(model, optimizer)], scheduler=scheduler, mesh=mesh, global_batch=4,
                                total_steps=10, identity={"config_hash": "h", "data_version": "v", "scheme": "ddp"})
    return manager, model, optimizer, scheduler


def _attempt(run, seed: int) -> dict[str, Any]:
    from dtk.checkpoint.load import CheckpointLoadError

    manager, model, *_ = _manager(run, seed)
    try:
        return {"step": manager.resume(), "weight": model.weight.detach().clone()}
    except CheckpointLoadError as exc:
        return {"error": str(exc)}
    finally:
        manager.close()


def check(rank: int, world: int, folder: str) -> dict[str, Any]:
    from dtk.checkpoint import load as loading
    from dtk.checkpoint.reading import HashingReader
    from dtk.common.rundir import RunDir

    out: dict[str, Any] = {}
    try:
        run = RunDir(Path(folder) / "run")
        if rank == 0:
            run.path.mkdir()
        dist.barrier()
        manager, model, optimizer, scheduler = _manager(run, seed=0)
        for step in (1, 2):
            model(torch.randn(4, 8)).square().mean().backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            manager.save(step)
        manager.close()
        out["saved"] = model.weight.detach().clone()

        real_rng, real_read = loading.set_rng_state, HashingReader.read_data
        if rank == 1:  # out of memory while applying the state, on this rank alone
            def no_memory(state):
                raise MemoryError("injected on rank 1")
            loading.set_rng_state = no_memory
        out["memory"] = _attempt(run, seed=9)
        loading.set_rng_state = real_rng

        if rank == 1:  # an I/O error reading a shard, on this rank alone
            def io_error(self, plan, planner):
                raise OSError(errno.EIO, "Input/output error (injected)")
            HashingReader.read_data = io_error
        out["io"] = _attempt(run, seed=9)
        HashingReader.read_data = real_read

        out["again"] = _attempt(run, seed=9)
        dist.barrier()
        out["folders"] = [(step, committed) for step, _, committed in checkpoint_steps(checkpoints_of(run))]
        out["events"] = [e["event"] for e in run.events_list()]
    except Exception:
        out["crash"] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("load")
    results = run_on_ranks(check, WORLD, folder, str(folder))
    for rank, r in enumerate(results):
        assert "crash" not in r, f"rank {rank}:\n{r['crash']}"
    return results


@pytest.mark.parametrize("case, cause", [("memory", "rank 1: MemoryError: injected on rank 1"),
                                         ("io", "Input/output error (injected)")])
def test_a_load_failing_on_one_rank_stops_every_rank_with_the_same_cause(ranks, case, cause):
    errors = [r[case].get("error") for r in ranks]
    assert errors[0] is not None and errors == [errors[0]] * WORLD, errors  # the same line on every rank
    assert cause in errors[0] and "checkpoint step_00000002 could not be read" in errors[0]
    assert "kept (not rejected)" in errors[0]


def test_nothing_was_rejected_or_deleted_and_the_checkpoint_then_loads(ranks):
    for r in ranks:
        assert r["folders"] == [(1, True), (2, True)]
        assert "checkpoint_rejected" not in r["events"]
        assert r["again"]["step"] == 2 and torch.equal(r["again"]["weight"], r["saved"])
