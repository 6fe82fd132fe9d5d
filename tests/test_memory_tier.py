"""The in-memory snapshot tier end to end (checkpoint.memory_every): two gloo workers under the
local driver, one SIGKILLed between disk checkpoints. The relaunch restores from its node's
/dev/shm store (`tier: memory`), redoes at most memory_every steps, and its losses equal the
uninterrupted run's; a corrupted shard falls back to disk with the reason; a store that
cannot be written costs the tier alone; a stopped or finished run leaves no store behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk, require
from dtk.checkpoint.memory import store as ms
from dtk.common.rundir import MEMORY_STORE_ENV, RunDir, memory_store, read_progress
from dtk.common.storage import checkpoint_steps, checkpoints_of, committed_steps
from dtk.report.goodput import account
from dtk.report.runs import load_run

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 24
JOB = [
    "tasks_per_node=2", f"train.steps={STEPS}", "train.global_batch=32", "train.micro_batch=8",
    "model.dropout=0.1",  # each rank's random stream matters: a restore must bring it back
    "train.log_every=1", "checkpoint.every=1000", "checkpoint.memory_every=2", "run.name=r",
    "fault.max_restarts=1",
]


def submit(root: Path, *extra: str, store: Path) -> subprocess.Popen:
    log = open(root / f"driver_{time.monotonic_ns()}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "dtk.submit", *JOB, *extra, f"run.root={root}"], cwd=root,
                            env=dict(os.environ, PYTHONPATH=str(REPO), **{MEMORY_STORE_ENV: str(store)}),
                            stdout=log, stderr=subprocess.STDOUT)


def losses(run: RunDir) -> dict[int, float]:
    return {s: r["loss"] for s, r in run.latest_metrics().items()}


def newest_commit(run: RunDir) -> int | None:
    held = ms.holdings(memory_store(run.path) / ms_node())
    complete = [s for s, h in held.items() if h["commit"] is not None]
    return max(complete, default=None)


def ms_node() -> str:
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def kill_one_worker_between_snapshots(root: Path, store: Path, *extra: str, corrupt: bool = False) -> tuple[int, int]:
    """Run the job, freeze both ranks once a committed snapshot is at most 2 steps behind, SIGKILL
    rank 1 (optionally corrupting its shard first); return (the step reached, the snapshot's step)."""
    os.environ[MEMORY_STORE_ENV] = str(store)  # memory_store() here reads the same root
    driver = submit(root, *extra, store=store)
    run = RunDir(root / "r")
    try:
        deadline = time.monotonic() + 240
        while True:
            assert driver.poll() is None and time.monotonic() < deadline, next(root.glob("driver_*.log")).read_text()
            time.sleep(0.005)
            progress = read_progress(run) if run.path.is_dir() else None
            if progress is None or progress[1] < 6:
                continue
            pids = [int((run.log_dir(0) / f"rank_{rank}.pid").read_text().split()[-1]) for rank in (0, 1)]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            progress, committed = read_progress(run), newest_commit(run)
            assert progress is not None
            disk = max(committed_steps(checkpoints_of(run)), default=0)  # the snapshot must be the newer tier
            if (committed is not None and 0 <= progress[1] - committed <= 2 and committed > disk
                    and (disk or not corrupt) and progress[1] < STEPS - 2):
                break
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        # Every shard of rank 1 on the node: the frozen rank 0 may still write the commit record
        # of a newer step whose shards are all in place (its gather passed before the freeze).
        for shard in memory_store(run.path).glob(f"*/step_*/{ms.shard_name('own', 1)}") if corrupt else ():
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        os.kill(pids[1], signal.SIGKILL)
        os.kill(pids[0], signal.SIGCONT)
        assert driver.wait(timeout=300) == 0, next(root.glob("driver_*.log")).read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
    return progress[1], committed


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run, tier off: the tier changes no loss."""
    root = tmp_path_factory.mktemp("reference")
    proc = dtk("dtk.submit", *JOB, "checkpoint.memory_every=0", f"run.root={root}", cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = losses(RunDir(root / "r"))
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


def test_a_killed_worker_restores_from_memory_redoes_at_most_two_steps_and_matches(reference, tmp_path):
    store = tmp_path / "shm"
    reached, snap = kill_one_worker_between_snapshots(tmp_path, store)
    run = RunDir(tmp_path / "r")
    loaded = [e for e in run.events_list() if e["event"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and loaded[0]["tier"] == "memory", loaded
    # The newest complete snapshot at the freeze, or the next one if its shards were all in place
    # and only rank 0's commit record was still to be written (it writes it once continued).
    restored = loaded[0]["step"]
    assert restored in (snap, snap + 2) and 0 <= reached - restored <= 2, (restored, snap, reached)
    assert not checkpoint_steps(checkpoints_of(run)) or max(s for s, _, _ in checkpoint_steps(checkpoints_of(run))) == STEPS  # only the final save
    assert losses(run) == reference
    assert not memory_store(run.path).exists(), "a finished run leaves its store behind"
    status = dtk("dtk.status", str(run.path), cwd=tmp_path)
    assert status.returncode == 0 and f"from step {restored} (memory)" in status.stdout, status.stdout + status.stderr
    starts = account(run.events_list(), load_run(run.path).metric_lines)["starts"]
    assert [s["tier"] for s in starts] == [None, "memory"]


def test_a_corrupt_shard_falls_back_to_disk_with_the_reason(reference, tmp_path):
    store = tmp_path / "shm"
    # disk checkpoints committed before the next step (synchronous), so the fallback has one to load
    reached, snap = kill_one_worker_between_snapshots(tmp_path, store, "checkpoint.every=5",
                                                      "checkpoint.async_save=false", corrupt=True)
    run = RunDir(tmp_path / "r")
    loaded = [e for e in run.events_list() if e["event"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and loaded[0]["tier"] == "disk", loaded
    assert "CRC mismatch" in loaded[0]["memory_fallback"] and "rank 1" in loaded[0]["memory_fallback"]
    assert loaded[0]["step"] < snap and loaded[0]["step"] % 5 == 0
    assert losses(run) == reference


def test_a_store_that_cannot_be_written_costs_the_tier_only(reference, tmp_path, monkeypatch):
    """Every snapshot fails (the node's folder of the store is a file; the root itself is fine,
    else the tier is refused at the start): each is a `memory_snapshot_failed` event with the
    reason, no rank waits on another, and the run ends with the losses of the run without the
    tier."""
    store = tmp_path / "shm"
    monkeypatch.setenv(MEMORY_STORE_ENV, str(store))
    node_store = memory_store(tmp_path / "r") / ms_node()
    node_store.parent.mkdir(parents=True, mode=0o700)
    os.chmod(store / f"dtk-{os.getuid()}", 0o700)
    node_store.write_text("not a folder")
    driver = submit(tmp_path, store=store)
    assert driver.wait(timeout=300) == 0, (tmp_path / "r" / "logs").glob("*")
    run = RunDir(tmp_path / "r")
    failed = [e for e in run.events_list() if e["event"] == "memory_snapshot_failed"]
    assert [e["step"] for e in failed] == list(range(2, STEPS, 2)), failed
    assert all("not kept (2 of 2 ranks failed)" in e["reason"] for e in failed), failed[0]
    assert losses(run) == reference


def test_a_stopped_run_leaves_no_store_in_dev_shm(tmp_path):
    os.environ.pop(MEMORY_STORE_ENV, None)
    driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", *JOB, "train.steps=400", f"run.root={tmp_path}"],
                              cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    run = RunDir(tmp_path / "r")
    store = memory_store(run.path)
    assert str(store).startswith("/dev/shm/")
    try:
        deadline = time.monotonic() + 240
        while not (store.is_dir() and newest_commit(run)):
            assert driver.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc = dtk("dtk.stop", str(run.path), cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert not store.exists(), sorted(store.rglob("*"))


@pytest.mark.parametrize("forge", ["another_user", "world_writable", "symlink"])
def test_a_store_root_this_user_does_not_own_alone_is_refused_and_the_run_finishes_on_disk(reference, tmp_path,
                                                                                              forge):
    """The store's root was made first by someone else (another uid), is writable by others, or
    is a symlink: the tier is refused at the start with one `memory_store_refused` event, no
    snapshot is written into it (nor any attempt counted as a failed snapshot), and the run
    finishes with the losses of the run without the tier."""
    if forge == "another_user":
        require(os.getuid() == 0, "needs root to give a folder to another user")
    store = tmp_path / "shm"
    root = store / f"dtk-{os.getuid()}"
    store.mkdir()
    if forge == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
    else:
        root.mkdir(mode=0o700)
        os.chmod(root, 0o777) if forge == "world_writable" else os.chown(root, 65534, 65534)
    driver = submit(tmp_path, store=store)
    assert driver.wait(timeout=300) == 0, [p.read_text() for p in tmp_path.glob("driver_*.log")]
    run = RunDir(tmp_path / "r")
    (refused,) = [e for e in run.events_list() if e["event"] == "memory_store_refused"]
    assert refused["path"] == str(root) and refused["node"] == ms_node(), refused
    assert {"another_user": "is owned by uid 65534", "world_writable": "mode 0777: group or others can write",
            "symlink": "is a symlink"}[forge] in refused["reason"], refused
    assert not [e for e in run.events_list() if e["event"] == "memory_snapshot_failed"]
    assert list((tmp_path / "elsewhere" if forge == "symlink" else root).iterdir()) == []
    assert losses(run) == reference
    assert run.read_summary()["status"] == "finished"
    log = (run.log_dir(0) / "rank_0.log").read_text()
    assert log.count("memory tier off: the store on") == 1, log


def test_a_later_job_on_the_node_sweeps_the_stores_that_ended_runs_left_there(tmp_path, monkeypatch):
    """A multi-node job that failed or was stopped with --now leaves its store on every node
    but the driver's. The next dtk job on such a node, here one with the tier off, removes the
    stores of this user's runs that are over, and leaves those of runs still going."""
    from dtk.checkpoint.memory import root as mroot

    store = tmp_path / "shm"
    monkeypatch.setenv(MEMORY_STORE_ENV, str(store))
    planted = {}
    for name, ends in (("failed", "failed"), ("stopped", "stopped"), ("running", "started")):
        run = RunDir(tmp_path / "old" / name)
        run.path.mkdir(parents=True)
        for event in ("submitted", "started", ends):
            run.event(event)
        planted[name] = memory_store(run.path)
        mroot.check_root(planted[name].parent, make=True)
        mroot.write_owner(planted[name], run_path=run.path, node="node2")
        ms.write_shard(planted[name] / "node2", 8, "own", 1, b"x" * 1000, 1)
    driver = submit(tmp_path, "checkpoint.memory_every=0", "train.steps=4", store=store)
    assert driver.wait(timeout=300) == 0, [p.read_text() for p in tmp_path.glob("driver_*.log")]
    assert {name: path.exists() for name, path in planted.items()} == {"failed": False, "stopped": False,
                                                                       "running": True}
