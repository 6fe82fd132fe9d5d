"""The memory tier's restore on real gloo ranks (dtk.checkpoint.memory.tier): FSDP2 state
snapshotted by 4 ranks on two nodes ("a": ranks 0, 1; "b": ranks 2, 3) is restored

- by the 2 ranks of node a alone (a shrink): their own shards and node b's replicas,
  resharded by DCP's planner from 4 pieces to 2, with no rank's RNG stream taken over;
- by 4 ranks where node b was replaced by an empty node c: ranks 2 and 3 receive their
  shards from node a's replicas (tier peer), and every rank gets its own RNG streams back;

each time equal, tensor for tensor, to the state the 4 ranks snapshotted (parameters, both
AdamW moments, the step count, the schedule's position). A corrupt layout falls back with the
reason on every rank. A snapshot that one rank cannot write is kept by none and stops no rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from multirank import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _build(seed: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _full(model, optimizer, scheduler) -> dict:
    out = {f"p.{k}": v.full_tensor().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(optimizer.state.values()):
        for k, v in st.items():
            out[f"o.{i}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    out["lr"] = torch.tensor(scheduler.get_last_lr())
    return out


def _tier(run: Path, model, optimizer, scheduler, *, rank: int, world: int, per_node: int, fresh: bool):
    from dtk.checkpoint.memory.tier import MemoryTier

    return MemoryTier(run, every=2, rank=rank, world=world, local_rank=rank % per_node, per_node=per_node,
                      parts=[(model, optimizer)], scheduler=scheduler, identity={"config_hash": "x"}, fresh=fresh,
                      generation=0)


def _snapshot(rank: int, world: int, root: str) -> dict:
    os.environ["DTK_MEMORY_STORE_ROOT"] = root
    os.environ["SLURMD_NODENAME"] = "ab"[rank // 2]
    model, optimizer, scheduler = _build(0, world)
    torch.manual_seed(100 + rank)
    for _ in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    tier = _tier(Path(root) / "run", model, optimizer, scheduler, rank=rank, world=world, per_node=2, fresh=True)
    tier.snapshot(2)
    tier.wait()
    full = _full(model, optimizer, scheduler)
    full["rng"] = torch.rand(3)  # what the rank's stream draws next
    return full


def _restore(rank: int, world: int, root: str, nodes: str, corrupt: bool) -> dict:
    from dtk.checkpoint.memory import store as ms
    from dtk.common.rundir import memory_store

    os.environ["DTK_MEMORY_STORE_ROOT"] = root
    os.environ["SLURMD_NODENAME"] = nodes[rank // 2]
    model, optimizer, scheduler = _build(1, world)  # other weights: the restore must replace them
    tier = _tier(Path(root) / "run", model, optimizer, scheduler, rank=rank, world=world, per_node=2, fresh=False)
    if corrupt and rank == 0:
        (layout,) = (memory_store(Path(root) / "run") / "a").glob(f"step_*/{ms.layout_name('replica', 2)}")
        layout.write_bytes(layout.read_bytes().replace(b'"lengths"', b'"lengthz"'))
    torch.manual_seed(7)
    choice, tiers, _ = tier.restore(disk_step=0)
    full = _full(model, optimizer, scheduler)
    full["rng"] = torch.rand(3)
    return {"step": choice.step, "from_world": choice.from_world, "reason": choice.reason, "tiers": tiers,
            "state": full}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "rng")


def test_a_snapshot_of_four_ranks_restores_on_two_by_resharding_and_on_a_replaced_node_from_replicas(tmp_path):
    root = str(tmp_path / "shm")
    before = run_on_ranks(_snapshot, 4, tmp_path / "snap", root)
    assert all(_equal(before[0], b) for b in before[1:])

    shrunk = run_on_ranks(_restore, 2, tmp_path / "shrink", root, "a", False)
    for got in shrunk:
        assert (got["step"], got["from_world"], got["reason"]) == (2, 4, None)
        assert got["tiers"] == {0: "memory", 1: "memory"}  # node a holds b's replicas
        assert _equal(got["state"], before[0])
        assert not any(torch.equal(got["state"]["rng"], b["rng"]) for b in before)  # no stream taken over

    replaced = run_on_ranks(_restore, 4, tmp_path / "replace", root, "ac", False)
    assert replaced[0]["tiers"] == {0: "memory", 1: "memory", 2: "peer", 3: "peer"}
    for rank, got in enumerate(replaced):
        assert (got["step"], got["from_world"]) == (2, 4) and _equal(got["state"], before[0])
        assert torch.equal(got["state"]["rng"], before[rank]["rng"])  # its own stream goes on


def test_a_corrupt_layout_falls_back_on_every_rank_with_the_reason(tmp_path):
    root = str(tmp_path / "shm")
    run_on_ranks(_snapshot, 4, tmp_path / "snap", root)
    got = run_on_ranks(_restore, 2, tmp_path / "shrink", root, "a", True)
    for g in got:
        assert g["step"] is None and "rank 2: CRC mismatch of its replica layout of step 2" in g["reason"], g["reason"]


def _snapshot_with_a_failed_write(rank: int, world: int, root: str) -> dict:
    from dtk.checkpoint.memory import store as ms

    os.environ["DTK_MEMORY_STORE_ROOT"] = root
    os.environ["SLURMD_NODENAME"] = "ab"[rank]
    model, optimizer, scheduler = _build(0, world)
    tier = _tier(Path(root) / "run", model, optimizer, scheduler, rank=rank, world=world, per_node=1, fresh=True)
    blocker = ms.step_dir(tier.store, 2)
    if rank == 1:  # node b's step folder cannot be made: a file is in its place
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("not a folder")
    tier.snapshot(2)
    tier.wait()  # returns on both ranks: rank 0 is not left waiting for rank 1's replica
    blocker.unlink(missing_ok=True)
    tier.snapshot(4)
    tier.wait()
    return {"failures": tier.failures, "held": {step: (h["commit"] is not None, h["own"], h["replica"])
                                                 for step, h in ms.holdings(tier.store).items()}}


def test_a_snapshot_that_one_rank_cannot_write_is_kept_by_none_and_the_next_one_is(tmp_path):
    got = run_on_ranks(_snapshot_with_a_failed_write, 2, tmp_path / "snap", str(tmp_path / "shm"))
    for rank, g in enumerate(got):
        ((step, failure),) = g["failures"]
        assert step == 2 and failure.startswith("step 2 not kept (1 of 2 ranks failed): rank 1 on b: FileExistsError"), failure
        assert g["held"] == {4: (True, [rank], [1 - rank])}, g["held"]  # nothing of step 2 is left on node a
