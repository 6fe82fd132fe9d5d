"""The memory tier's trust on real gloo ranks (dtk.checkpoint.memory.tier), two ranks on two
"nodes" ("a" and "b", each its own store root): a root another user owns on node b turns
the tier off on both ranks (one `memory_store_refused` event, no snapshot written, a restore
falls back with the reason); a trusted store holds 0600 files in 0700 folders; a rollback
removes the abandoned snapshots on every node and later ones are of the next generation,
which a later start (its generation read from the rollbacks recorded) restores, never an
abandoned one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from conftest import require
from multirank import run_on_ranks

pytestmark = [pytest.mark.dist]


def _tier(rank: int, roots: list[str], run: Path, *, fresh: bool, generation: int):
    from dtk.checkpoint.memory.tier import MemoryTier

    os.environ["DTK_MEMORY_STORE_ROOT"] = roots[rank]
    os.environ["SLURMD_NODENAME"] = "ab"[rank]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    tier = MemoryTier(run, every=2, rank=rank, world=2, local_rank=0, per_node=1, parts=[(model, optimizer)],
                      scheduler=scheduler, identity={"config_hash": "x"}, fresh=fresh, generation=generation)
    return tier, model, optimizer


def _train_to(model, optimizer, step: int) -> None:
    """The state of `step`: each step's weights differ (the restore must bring back the right one)."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))


def _refused(rank: int, world: int, roots: list[str], run: str) -> dict:
    tier, model, optimizer = _tier(rank, roots, Path(run), fresh=True, generation=0)
    tier.snapshot(2)
    tier.wait()
    choice, _, _ = tier.restore(disk_step=0)
    tier.close(discard=True)
    return {"refused": tier.refused, "reason": choice.reason, "step": choice.step,
            "files": sorted(str(p) for p in Path(roots[rank]).rglob("*") if p.is_file())}


def test_a_root_another_user_owns_on_one_node_turns_the_tier_off_on_every_rank(tmp_path):
    require(os.getuid() == 0, "needs root to give a folder to another user")
    from dtk.common.rundir import RunDir

    roots = [str(tmp_path / "shm_a"), str(tmp_path / "shm_b")]
    for r in roots:
        os.mkdir(r)
    forged = Path(roots[1]) / f"dtk-{os.getuid()}"
    forged.mkdir(mode=0o700)
    os.chown(forged, 65534, 65534)  # made first by another user
    run = tmp_path / "run"
    run.mkdir()
    got = run_on_ranks(_refused, 2, tmp_path, roots, str(run))
    why = f"{forged} is owned by uid 65534, not by this user (uid {os.getuid()})"
    for g in got:
        assert g["refused"] == f"on b: {why}"
        assert g["step"] is None and g["reason"] == f"the memory store is refused (on b: {why})"
        assert g["files"] == []  # node a wrote nothing either: its replicas would go to b
    (event,) = [e for e in RunDir(run).events_list() if e["event"] == "memory_store_refused"]
    assert (event["node"], event["reason"], event["path"]) == ("b", why, str(forged))


def _generations(rank: int, world: int, roots: list[str], run: str) -> dict:
    from dtk.checkpoint.memory import store as ms

    tier, model, optimizer = _tier(rank, roots, Path(run), fresh=True, generation=0)
    for step in (2, 4, 6):
        _train_to(model, optimizer, step)
        tier.snapshot(step)
    tier.wait()
    modes = {str(p): stat.S_IMODE(os.lstat(p).st_mode) for p in Path(roots[rank]).rglob("*")}
    modes[roots[rank] + "/root"] = stat.S_IMODE(os.lstat(tier.root).st_mode)
    before = sorted(ms.holdings(tier.store))
    tier.rolled_back(4)  # the divergence: back to step 4, step 6 abandoned
    after_rollback = sorted(ms.holdings(tier.store))
    _train_to(model, optimizer, 105)  # the new trajectory's step 5: the next snapshot is not yet
    tier.close(discard=False)  # the worker is killed: the store stays
    # A later start of the run: its generation is the rollbacks recorded (1)
    again, model, optimizer = _tier(rank, roots, Path(run), fresh=False, generation=1)
    choice, _, _ = again.restore(disk_step=4)
    again.close(discard=False)
    return {"modes": modes, "before": before, "after_rollback": after_rollback, "step": choice.step,
            "reason": choice.reason}


def test_a_rollback_removes_the_abandoned_snapshots_and_a_restore_takes_the_new_trajectorys(tmp_path):
    roots = [str(tmp_path / "shm_a"), str(tmp_path / "shm_b")]
    for r in roots:
        os.mkdir(r)
    run = tmp_path / "run"
    run.mkdir()
    got = run_on_ranks(_generations, 2, tmp_path, roots, str(run))
    for g in got:
        files = {p: m for p, m in g["modes"].items() if p.endswith((".pt", ".crc", ".json"))}
        folders = {p: m for p, m in g["modes"].items() if p not in files}
        assert len(files) >= 14 and set(files.values()) == {0o600}, files  # 2 steps x (own + replica) x 3 + commits
        assert set(folders.values()) == {0o700}, folders
        assert g["before"] == [4, 6] and g["after_rollback"] == [4]  # 6 gone on both nodes
        # the crash after the rollback: the abandoned step 6 is not restored (the disk's 4 is)
        assert g["step"] is None and g["reason"] == "the newest snapshot (step 4) was taken before a rollback", g["reason"]


def _new_trajectory(rank: int, world: int, roots: list[str], run: str) -> dict:
    from dtk.checkpoint.memory import store as ms

    tier, model, optimizer = _tier(rank, roots, Path(run), fresh=True, generation=0)
    for step in (2, 4, 6, 8):
        _train_to(model, optimizer, step)
        tier.snapshot(step)
    tier.wait()
    tier.rolled_back(4)  # back to step 4: 6 and 8 abandoned
    _train_to(model, optimizer, 106)  # the new trajectory's step 6
    tier.snapshot(6)
    tier.close(discard=False)  # killed at its step 7
    again, model, optimizer = _tier(rank, roots, Path(run), fresh=False, generation=1)
    choice, _, _ = again.restore(disk_step=4)
    again.close(discard=False)
    return {"held": sorted(ms.holdings(again.store)), "step": choice.step, "weight": float(model.weight[0, 0])}


def test_after_a_rollback_the_new_trajectorys_snapshot_is_restored_and_kept_by_the_prune(tmp_path):
    roots = [str(tmp_path / "shm_a"), str(tmp_path / "shm_b")]
    for r in roots:
        os.mkdir(r)
    run = tmp_path / "run"
    run.mkdir()
    for g in run_on_ranks(_new_trajectory, 2, tmp_path, roots, str(run)):
        assert g["held"] == [6] and (g["step"], g["weight"]) == (6, 106.0), g


def _left_behind(rank: int, world: int, roots: list[str], runs: dict[str, str]) -> dict:
    from dtk.common.rundir import memory_store

    for name in ("failed", "running"):  # two earlier jobs, killed on this node before their stores went
        tier, model, optimizer = _tier(rank, roots, Path(runs[name]), fresh=True, generation=0)
        _train_to(model, optimizer, 2)
        tier.snapshot(2)
        tier.close(discard=False)
    if rank == 0:
        from dtk.common.rundir import RunDir

        for name, ends in (("failed", "failed"), ("running", "relaunched")):
            for event in ("submitted", "started", ends):
                RunDir(Path(runs[name])).event(event)
    torch.distributed.barrier()
    left = {name: memory_store(Path(path)).is_dir() for name, path in runs.items()}
    tier, _, _ = _tier(rank, roots, Path(runs["new"]), fresh=True, generation=0)  # a later job on these nodes
    kept = {name: memory_store(Path(path)).is_dir() for name, path in runs.items()}
    tier.close(discard=True)
    return {"left": left, "kept": kept}


def test_a_tier_start_on_a_node_sweeps_the_stores_that_ended_runs_left_there(tmp_path):
    roots = [str(tmp_path / "shm_a"), str(tmp_path / "shm_b")]
    for r in roots:
        os.mkdir(r)
    runs = {name: str(tmp_path / name) for name in ("failed", "running", "new")}
    for path in runs.values():
        os.mkdir(path)
    for g in run_on_ranks(_left_behind, 2, tmp_path, roots, runs):
        assert g["left"] == {"failed": True, "running": True, "new": False}
        assert g["kept"] == {"failed": False, "running": True, "new": True}  # on node a and on node b
