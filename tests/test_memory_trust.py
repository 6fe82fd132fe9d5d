"""What the memory tier trusts (dtk.checkpoint.memory.root, memory_store): its store's root
only when this user made it and no one else can write or swap it; snapshot files readable
by their owner only; a snapshot only of the run's current generation (a rollback abandons
the steps after its checkpoint); and stores of runs that are over swept from the node.
Real files and folders; another user's root is a real chown (root only)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from conftest import require
from dtk.checkpoint.memory import root as mroot
from dtk.checkpoint.memory import store as ms
from dtk.common.rundir import RunDir

NOBODY = 65534
IDENTITY = {"config_hash": "abc"}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def refusal(root: Path) -> str:
    with pytest.raises(mroot.StoreRefused) as info:
        mroot.check_root(root, make=True)
    return str(info.value)


def test_the_root_is_made_0700_by_this_user_and_passes(tmp_path):
    root = tmp_path / "dtk-1"
    old = os.umask(0)
    try:
        mroot.check_root(root, make=True)
    finally:
        os.umask(old)
    assert mode(root) == 0o700 and os.stat(root).st_uid == os.getuid()
    mroot.check_root(root)  # and again at the next use


def test_a_root_another_user_owns_is_refused(tmp_path):
    require(os.getuid() == 0, "needs root to give a folder to another user")
    root = tmp_path / "dtk-0"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    assert refusal(root) == f"{root} is owned by uid {NOBODY}, not by this user (uid {os.getuid()})"


@pytest.mark.parametrize("bits", [0o770, 0o707, 0o777])
def test_a_root_group_or_others_can_write_is_refused(tmp_path, bits):
    root = tmp_path / "dtk-0"
    root.mkdir()
    os.chmod(root, bits)
    assert "group or others can write in it" in refusal(root)
    assert mode(root) == bits  # refused, not repaired: someone may have written into it


def test_a_symlinked_root_is_refused_even_to_a_folder_of_this_user(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    root = tmp_path / "dtk-0"
    root.symlink_to(real)
    assert refusal(root) == f"{root} is a symlink or not a folder"
    (tmp_path / "dtk-1").write_text("a file")
    assert refusal(tmp_path / "dtk-1") == f"{tmp_path / 'dtk-1'} is a symlink or not a folder"


def test_a_root_of_this_user_that_others_can_read_is_closed_to_0700(tmp_path):
    root = tmp_path / "dtk-0"
    root.mkdir()
    os.chmod(root, 0o755)  # as an older dtk made it
    mroot.check_root(root)
    assert mode(root) == 0o700


@pytest.mark.parametrize("bits", [0o777, 0o770])
def test_a_parent_others_can_write_and_not_sticky_is_refused_even_this_users_own(tmp_path, bits):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, bits)  # whoever may write in it may rename the root away and put another there
    assert "is writable by group or others and not sticky" in refusal(parent / "dtk-0")
    assert not (parent / "dtk-0").exists()
    os.chmod(parent, 0o1000 | bits)  # /dev/shm: sticky, so no one renames another user's entry
    mroot.check_root(parent / "dtk-0", make=True)


def test_shards_layouts_crcs_and_commits_are_0600_in_0700_folders(tmp_path):
    store = tmp_path / "dtk-0" / "run" / "node"
    old = os.umask(0)  # even a umask that takes nothing away
    try:
        ms.write_shard(store, 4, "own", 0, b"data", 7, b"{}")
        ms.write_commit(store, ms.commit_record(4, world_size=1, identity=IDENTITY, crcs=[7], layout_crcs=[1]))
        mroot.write_owner(store.parent, run_path=tmp_path / "r", node="node")
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "dtk-0").rglob("*") if p.is_file()]
    folders = [tmp_path / "dtk-0", *(p for p in (tmp_path / "dtk-0").rglob("*") if p.is_dir())]
    assert len(files) == 5 and {mode(p) for p in files} == {0o600}, {p.name: oct(mode(p)) for p in files}
    assert len(folders) == 4 and {mode(p) for p in folders} == {0o700}, {str(p): oct(mode(p)) for p in folders}


def commit(step: int, generation: int) -> dict:
    return ms.commit_record(step, world_size=1, identity=IDENTITY, crcs=[1], layout_crcs=[2], generation=generation)


def one_node(steps: dict[int, int]) -> list[dict]:
    """One rank, its node's store: {step: generation of its commit}."""
    return [{"node": "a", "steps": {s: {"commit": commit(s, g), "own": [0], "replica": []} for s, g in steps.items()}}]


def test_a_snapshot_of_an_abandoned_generation_is_never_restored():
    # Rolled back to 4: steps 6 and 8 of generation 0 are the abandoned trajectory.
    choice = ms.choose(one_node({6: 1, 8: 0}), world=1, identity=IDENTITY, disk_step=4, generation=1)
    assert choice.step == 6
    none = ms.choose(one_node({6: 0, 8: 0}), world=1, identity=IDENTITY, disk_step=4, generation=1)
    assert none.step is None and none.reason == "the newest snapshot (step 8) was taken before a rollback"
    assert ms.choose(one_node({6: 0, 8: 0}), world=1, identity=IDENTITY, disk_step=4, generation=0).step == 8


def test_a_node_whose_step_is_of_another_generation_holds_none_of_its_shards():
    """Node b was down during the rollback: its step 6 is the old trajectory's; node a's is new.
    Rank 1's shard of the new step 6 is nowhere, so step 6 is not restored from b's old one."""
    new, old = commit(6, 1), commit(6, 0)
    new["world_size"] = old["world_size"] = 2
    new["crcs"] = old["crcs"] = [1, 1]
    new["layout_crcs"] = old["layout_crcs"] = [2, 2]
    a = {"node": "a", "steps": {6: {"commit": new, "own": [0], "replica": []}}}
    b = {"node": "b", "steps": {6: {"commit": old, "own": [1], "replica": [0]}}}
    choice = ms.choose([a, b], world=2, identity=IDENTITY, disk_step=4, generation=1)
    assert choice.step is None and "rank 1's shard is on no node" in choice.reason


def test_prune_drops_other_generations_and_keeps_the_two_newest_of_this_one(tmp_path):
    for step, generation in ((6, 0), (8, 0), (10, 0), (6, 1), (8, 1)):
        ms.write_shard(tmp_path, step, "own", 0, b"x", 1)
        ms.write_commit(tmp_path, commit(step, generation))
    # 10 is left from generation 0: a plain "two newest" would keep 8 and 10 and drop the new 6
    ms.prune(tmp_path, generation=1)
    held = ms.holdings(tmp_path)
    assert sorted(held) == [6, 8] and {ms.generation_of(h["commit"]) for h in held.values()} == {1}


def test_remove_after_drops_the_steps_past_the_rollback_and_keeps_the_rest(tmp_path):
    for step in (2, 4, 6, 8):
        ms.write_shard(tmp_path, step, "own", 0, b"x", 1)
    assert ms.remove_after(tmp_path, 4) == [6, 8]
    assert sorted(ms.holdings(tmp_path)) == [2, 4]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing half-removed left


def started_run(path: Path, *events: str) -> Path:
    path.mkdir(parents=True)
    run = RunDir(path)
    for name in events:
        run.event(name)
    return path


def test_the_sweep_removes_this_users_stores_of_runs_that_are_over_only(tmp_path):
    root = tmp_path / "shm" / "dtk-0"
    root.parent.mkdir()
    mroot.check_root(root, make=True)
    runs = {
        "failed": started_run(tmp_path / "failed", "submitted", "started", "failed"),
        "stopped": started_run(tmp_path / "stopped", "submitted", "started", "stopped"),
        "finished": started_run(tmp_path / "finished", "submitted", "started", "relaunched", "started", "finished"),
        "gone": tmp_path / "gone",
        "running": started_run(tmp_path / "running", "submitted", "started"),
        "resubmitted": started_run(tmp_path / "resubmitted", "submitted", "started", "stopped", "submitted"),
        "requeued": started_run(tmp_path / "requeued", "submitted", "started", "requeued"),
    }
    for name, run_path in runs.items():
        mroot.write_owner(root / name, run_path=run_path, node="n1")
        ms.write_shard(root / name / "n1", 2, "own", 0, b"x", 1)
    (root / "no-owner" / "n1").mkdir(parents=True)  # an older dtk's store, or one being made
    (root / "mine").mkdir()
    mroot.write_owner(root / "mine", run_path=tmp_path / "failed", node="n1")  # the run starting again
    removed = mroot.sweep(root, keep=root / "mine")
    assert sorted(p.name for p in removed) == ["failed", "finished", "gone", "stopped"]
    assert sorted(p.name for p in root.iterdir()) == ["mine", "no-owner", "requeued", "resubmitted", "running"]
    owner = json.loads((root / "running" / mroot.OWNER).read_text())
    assert owner["run"] == str(runs["running"].resolve()) and owner["node"] == "n1"


def test_a_local_run_whose_driver_on_this_host_died_without_an_end_is_over(tmp_path):
    """A local driver SIGKILLed writes no end: its `started` event names a pid of this host that
    is gone. A live one (this process) runs; one on another host cannot be asked, so it runs."""
    import socket
    import subprocess
    import sys

    from dtk.common.processes import process_identity

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = process_identity(dead.pid)
    dead.wait()
    here = [socket.gethostname()]
    for name, nodes, who in (("killed", here, identity), ("alive", here, process_identity()),
                             ("elsewhere", ["another-host"], identity)):
        run = RunDir(tmp_path / name)
        run.path.mkdir()
        run.event("submitted")
        run.event("started", nodes=nodes, **who)
    assert [mroot.run_over(tmp_path / n) for n in ("killed", "alive", "elsewhere")] == [True, False, False]
