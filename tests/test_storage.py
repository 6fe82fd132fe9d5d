"""The checkpoint storage seam (dtk.common.storage) on both backends: local files and an
S3-compatible object store (moto's server, started on 127.0.0.1 by these tests). Each test
runs the same checks on both: reads, writes, listing, deletion, the commit by a manifest
written last, a save without its manifest never counting, a corrupt object refused by its
CRC, retention; and every lookup of a run's checkpoints through the store its plan.json
records (the driver's newest committed step, list, delete, the resume=false refusal, a
rollback, the storage drill's refusal). Real saves and loads (DCP, the Saver), no mocks of
the store."""

from __future__ import annotations

import json
import os
import socket
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from test_checkpoint import make_parts, params, train_step

from conftest import new_bucket, run_main
from dtk.checkpoint import load as loading
from dtk.checkpoint import manifest as mf
from dtk.checkpoint import sharded as ckpt
from dtk.checkpoint.delete import delete_checkpoint
from dtk.checkpoint.hashing import HashingFileSystem, HashingFsspecFileSystem
from dtk.checkpoint.manager import CheckpointManager
from dtk.checkpoint.retention import prune
from dtk.common import storage as storage_module
from dtk.common.errors import UserError
from dtk.common.rundir import MANIFEST, TRAINER_STATE, RunDir
from dtk.common.storage import (
    LocalStorage,
    Storage,
    StoreUnreachable,
    check_location,
    checkpoint_folder,
    checkpoint_steps,
    checkpoints_of,
    committed_steps,
    latest_committed_step,
    open_storage,
)
from dtk.config.schema import CheckpointConfig
from dtk.driver.record import latest_checkpoint_step, record_stopped
from dtk.mesh.mesh import ParallelMesh
from dtk.train.divergence import BadStep, Rollback
from dtk.train.rollback import roll_back

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def store(request, tmp_path) -> Storage:
    if request.param == "local":
        return LocalStorage(tmp_path / "checkpoints")
    request.getfixturevalue("s3")
    return open_storage(f"s3://{new_bucket()}/team/run1")


def save(store: Storage, step: int, model, optimizer) -> Storage:
    """A real synchronous save of one process into `store`'s step folder."""
    folder = checkpoint_folder(store, step)
    saver = ckpt.Saver(ckpt.Comm(None), asynchronous=False, on_commit=lambda manifest: None)
    try:
        saver.start(folder, parts=[(model, optimizer)], trainer_state={"step": step, "world_size": 1},
                    header={"step": step, "samples_consumed": 4 * step, "global_batch": 4, "world_size": 1})
    finally:
        saver.close()
    return folder


def test_files_are_written_listed_read_and_deleted(store):
    folder = store.child("step_00000001")
    assert folder.files() == [] and not folder.exists("a.bin")
    folder.create()
    folder.write_bytes("a.bin", b"x" * 1000)
    folder.write_bytes("b.json", b"{}")
    folder.write_bytes("a.bin", b"y" * 10)  # replaced whole
    assert folder.files() == ["a.bin", "b.json"]
    assert folder.size("a.bin") == 10 and folder.read_bytes("a.bin") == b"y" * 10
    assert folder.read_bytes("a.bin", 3) == b"yyy"
    assert store.folders() == ["step_00000001"]
    with pytest.raises(FileNotFoundError):
        folder.size("missing")
    folder.delete()
    assert folder.files() == [] and store.folders() == []
    folder.delete()  # deleting what is gone is no error


def test_a_saved_checkpoint_commits_verifies_and_loads_bitwise(store):
    model, optimizer, scheduler = make_parts(0)
    train_step(model, optimizer, scheduler)
    folder = save(store, 1, model, optimizer)
    assert [(step, committed) for step, _, committed in checkpoint_steps(store)] == [(1, True)]
    [listing] = mf.list_checkpoints(store)
    assert listing.committed and listing.verified, listing.reason
    assert set(listing.manifest["files"]) == set(mf.payload_files(folder))
    assert {TRAINER_STATE, ".metadata", "rng_00000.pt"} <= set(listing.manifest["files"])

    fresh, fresh_optimizer, _ = make_parts(1)
    assert any(not torch.equal(a, b) for a, b in zip(params(fresh), params(model), strict=True))
    comm = ckpt.Comm(None)
    manifest = loading.verify(comm, folder)
    state, rng_restored = loading.load(folder, parts=[(fresh, fresh_optimizer)], comm=comm, manifest=manifest)
    assert state["step"] == 1 and rng_restored
    assert all(torch.equal(a, b) for a, b in zip(params(fresh), params(model), strict=True))
    exp = optimizer.state_dict()["state"]
    got = fresh_optimizer.state_dict()["state"]
    assert all(torch.equal(exp[k]["exp_avg"], got[k]["exp_avg"]) for k in exp)


def test_the_manifest_is_the_last_object_written(store, monkeypatch):
    """The commit point: every shard, .metadata and small file is written before manifest.json
    (each write recorded as it completes, through the real writers)."""
    order: list[str] = []
    write_json, save_rng_to = mf.write_json, ckpt.save_rng_to

    def recorded_json(folder, name, obj):
        write_json(folder, name, obj)
        order.append(name)

    def recorded_rng(folder, name, state):
        save_rng_to(folder, name, state)
        order.append(name)

    monkeypatch.setattr(mf, "write_json", recorded_json)
    monkeypatch.setattr(ckpt, "save_rng_to", recorded_rng)
    for cls in (HashingFileSystem, HashingFsspecFileSystem):  # DCP's shards and .metadata
        def recorded_stream(self, path, mode, stream=cls.create_stream):
            with stream(self, path, mode) as fh:
                yield fh
            if "w" in mode:
                order.append(os.path.basename(os.fspath(path)))

        monkeypatch.setattr(cls, "create_stream", contextmanager(recorded_stream))
    model, optimizer, _ = make_parts(0)
    folder = save(store, 2, model, optimizer)
    assert order[-1] == MANIFEST and order.count(MANIFEST) == 1
    written = set(order[:-1])
    assert {TRAINER_STATE, "rng_00000.pt"} <= written
    assert any(name.endswith(".distcp") for name in written) and any(".metadata" in n for n in written)
    assert set(mf.read_manifest(folder)["files"]) == set(mf.payload_files(folder))


def test_a_save_killed_before_its_manifest_never_counts(store, monkeypatch):
    model, optimizer, _ = make_parts(0)
    save(store, 1, model, optimizer)

    def killed(folder, manifest):
        raise OSError("killed before the commit")

    monkeypatch.setattr(mf, "commit", killed)
    with pytest.raises(ckpt.SaveFailed, match="killed before the commit"):
        save(store, 2, model, optimizer)
    monkeypatch.undo()
    folder = checkpoint_folder(store, 2)
    assert any(name.endswith(".distcp") for name in folder.files())  # the shards are there
    assert [(step, committed) for step, _, committed in checkpoint_steps(store)] == [(1, True), (2, False)]
    with pytest.raises(mf.Rejected, match="no manifest.json"):
        mf.verify(folder)
    listed = {c.step: c.verified for c in mf.list_checkpoints(store)}
    assert listed == {1: True, 2: False}
    # the next save of step 2 replaces the leftover folder and commits
    save(store, 2, model, optimizer)
    assert [c.verified for c in mf.list_checkpoints(store)] == [True, True]


def test_a_corrupt_object_is_refused_by_its_crc_before_anything_parses_it(store):
    model, optimizer, _ = make_parts(0)
    folder = save(store, 1, model, optimizer)
    shard = next(name for name in folder.files() if name.endswith(".distcp"))
    data = bytearray(folder.read_bytes(shard))
    data[len(data) // 2] ^= 0xFF  # same size: only the CRC can tell
    folder.write_bytes(shard, bytes(data))
    assert mf.verify(folder, checksums=False)  # sizes match
    with pytest.raises(mf.Rejected, match=f"{shard} crc32"):
        mf.verify(folder)
    fresh, fresh_optimizer, _ = make_parts(1)
    before = params(fresh)
    comm = ckpt.Comm(None)
    with pytest.raises(mf.Rejected, match="crc32"):
        loading.load(folder, parts=[(fresh, fresh_optimizer)], comm=comm, manifest=loading.verify(comm, folder))
    assert all(torch.equal(a, b) for a, b in zip(params(fresh), before, strict=True))  # nothing applied
    # a changed .metadata is refused before it is unpickled
    meta = bytearray(folder.read_bytes(".metadata"))
    meta[-2] ^= 0xFF
    folder.write_bytes(".metadata", bytes(meta))
    with pytest.raises(mf.Rejected, match=r"\.metadata crc32"):
        loading.verify(comm, folder)


def test_retention_deletes_old_and_uncommitted_folders(store):
    model, optimizer, _ = make_parts(0)
    for step in (1, 2, 3):
        save(store, step, model, optimizer)
    checkpoint_folder(store, 4).write_bytes("__0_0.distcp", b"left by a killed save")  # newer, uncommitted
    deleted = prune(store, keep=2, current_step=3, protect=[3])
    assert sorted(p.name for p in deleted) == ["step_00000001", "step_00000004"]
    assert [(s, c) for s, _, c in checkpoint_steps(store)] == [(2, True), (3, True)]
    assert checkpoint_folder(store, 1).files() == []


@pytest.mark.parametrize("url, says", [
    ("s3://Bad_Bucket/x", "not a valid S3 URL"),
    ("s3://ab/x", "not a valid S3 URL"),
    ("s3://bucket/a/../b", "'..'"),
    ("s3://bucket/x?versionId=1", "not a valid S3 URL"),
    ("gs://bucket/x", "unknown scheme 'gs'"),
])
def test_a_malformed_location_is_one_user_error(url, says):
    with pytest.raises(UserError, match="checkpoint.dir=") as err:
        open_storage(url)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_s3_without_s3fs_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs raises ImportError
    with pytest.raises(UserError, match=r'needs s3fs, which is not installed; pip install "dtk-train\[s3\]"'):
        open_storage("s3://bucket/prefix")


@pytest.mark.parametrize("extra, says", [
    (["checkpoint.dir=s3://Bad_Bucket/x"], "checkpoint.dir=s3://Bad_Bucket/x: not a valid S3 URL"),
    (["checkpoint.dir=/scratch/ckpts"], "a local folder other than the run directory's is not supported"),
    (["checkpoint.dir=s3://bucket/x", "checkpoint.async_mode=process"], "checkpoint.async_mode=process writes local"),
])
def test_submit_refuses_a_bad_checkpoint_location_with_one_line_and_writes_nothing(tmp_path, extra, says):
    ran = run_main("dtk.submit", *extra, "train.steps=2", f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert ran.returncode == 2, ran.stdout + ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], ran.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_slurm_job_may_checkpoint_to_an_object_store_and_its_script_carries_no_credential(tmp_path, monkeypatch):
    """No refusal for a Slurm job any more (its driver reads the store: dtk.driver.record), and
    the batch script neither names the AWS_* values nor limits what sbatch exports: the job
    inherits them from the submitting shell (sbatch's default --export=ALL)."""
    check_location("s3://bucket/x", async_save=True, async_mode="thread")
    check_location("", async_save=True, async_mode="process")  # the default: no check
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-in-any-file-4711")
    ran = run_main("dtk.submit", "cluster=slurm", "checkpoint.dir=s3://bucket/x", "submit.dry_run=true",
                   f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    script = ran.stdout.split("would submit this sbatch script:\n\n", 1)[1]
    assert "#SBATCH --nodes=" in script and "--export" not in script and "AWS_" not in script
    assert "not-in-any-file-4711" not in ran.stdout + ran.stderr


def make_run(root, url: str) -> tuple[RunDir, Storage]:
    """A run directory whose plan.json records checkpoint.dir `url` (empty: RUN_DIR/checkpoints/),
    and the store its checkpoints are in."""
    run = RunDir(root / "runs" / "r1")
    run.path.mkdir(parents=True)
    run.plan_json.write_text(json.dumps({"steps": 10, "config_hash": "abc", "config": {"checkpoint": {"dir": url}}}))
    return run, (open_storage(url).child(run.path.name) if url else LocalStorage(run.checkpoints))


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def run_store(request, tmp_path) -> tuple[RunDir, Storage]:
    """A run with its checkpoints in RUN_DIR/checkpoints/, or in a prefix of moto's S3."""
    if request.param == "local":
        return make_run(tmp_path, "")
    request.getfixturevalue("s3")
    return make_run(tmp_path, f"s3://{new_bucket()}/team")


def saved_run(run_store, steps=(1, 2)) -> tuple[RunDir, Storage]:
    """Committed checkpoints of `steps` and a killed save of the step after (shards, no manifest)."""
    run, store = run_store
    model, optimizer, _ = make_parts(0)
    for step in steps:
        save(store, step, model, optimizer)
    checkpoint_folder(store, steps[-1] + 1).write_bytes("__0_0.distcp", b"left by a killed save")
    return run, store


def test_every_lookup_of_a_runs_committed_steps_reads_where_its_checkpoint_dir_puts_them(run_store):
    """The driver's (requeue, progress, stopped record), the listing and status read the run's
    store; with an object store nothing is in RUN_DIR/checkpoints/ for a folder lookup to find."""
    run, store = saved_run(run_store)
    assert checkpoints_of(run).url == store.url
    assert [(s, ok) for s, _, ok in checkpoint_steps(store)] == [(1, True), (2, True), (3, False)]
    assert committed_steps(store) == [1, 2] and latest_committed_step(store) == 2
    assert latest_checkpoint_step(run) == 2  # what the Slurm driver decides a requeue by
    assert [(c.step, c.verified) for c in mf.list_checkpoints(run)] == [(1, True), (2, True), (3, False)]
    assert record_stopped(run, by="test", restarts=0) == 2 and run.read_summary()["checkpoint"] == 2
    if not isinstance(store, LocalStorage):  # nothing in RUN_DIR/checkpoints/ for a folder lookup to find
        assert not run.checkpoints.exists() and latest_committed_step(LocalStorage(run.checkpoints)) is None


def test_a_retired_checkpoint_is_gone_and_one_cut_short_is_never_committed(run_store, monkeypatch):
    run, store = saved_run(run_store, steps=(1, 2, 3))
    checkpoint_folder(store, 3).retire("rolled-back")
    assert committed_steps(store) == [1, 2] and checkpoint_folder(store, 3).files() == []

    def cut_short(*args, **kwargs):
        raise OSError("the connection dropped")

    folder = checkpoint_folder(store, 2)
    if isinstance(folder, LocalStorage):
        monkeypatch.setattr(storage_module.shutil, "rmtree", cut_short)  # after the rename
    else:
        monkeypatch.setattr(folder.fs, "rm", cut_short)  # after the manifest's DELETE
    with pytest.raises(OSError, match="dropped"):
        folder.retire("deleting")
    if not isinstance(folder, LocalStorage):
        folder.retire("deleting", ignore_errors=True)  # the rest may stay: the commit is gone
    monkeypatch.undo()
    assert committed_steps(store) == [1]  # what is left never counts as a checkpoint
    assert latest_checkpoint_step(run) == 1


def test_the_delete_command_takes_a_checkpoint_from_the_runs_store(run_store):
    run, store = saved_run(run_store)
    with pytest.raises(UserError, match="--step 2 is the newest verified checkpoint"):
        delete_checkpoint(run.path, step=2)
    assert delete_checkpoint(run.path, step=1) == f"deleted checkpoint step 1 ({checkpoint_folder(store, 1)})"
    assert committed_steps(store) == [2]
    with pytest.raises(UserError, match=f"no checkpoint of that step in {store}"):
        delete_checkpoint(run.path, step=1)


def test_a_start_over_is_refused_where_the_runs_store_holds_committed_checkpoints(run_store):
    run, _ = saved_run(run_store)
    url = json.loads(run.plan_json.read_text())["config"]["checkpoint"]["dir"]
    ran = run_main("dtk.submit", "checkpoint.resume=false", f"checkpoint.dir={url}", "train.steps=2",
                   f"run.root={run.path.parent}", f"run.name={run.path.name}", cwd=run.path.parent)
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert ran.stderr.strip() == (f"error: checkpoint.resume=false: {run.path} holds committed checkpoints (step 1, 2)"
                                  " that starting over would delete; use another run.name to start a new run, or"
                                  " leave checkpoint.resume unset to continue this one")


@pytest.mark.slow
def test_the_storage_drill_refuses_a_run_in_an_object_store_with_one_line(s3, tmp_path):
    run, _ = saved_run(make_run(tmp_path, f"s3://{new_bucket()}/team"))
    ran = run_main("dtk.drill", "storage", str(run.path), "--hold", "1")
    assert ran.returncode == 2, ran.stdout + ran.stderr
    [line] = ran.stderr.strip().splitlines()
    assert line.startswith("error: storage: the drill makes a local checkpoint folder read-only") and "s3://" in line


def run_manager(run: RunDir, url: str, parts, *, keep: int = 10):
    model, optimizer, scheduler = parts
    return CheckpointManager(
        run, checkpoint=CheckpointConfig(every=1, keep=keep, async_save=True, dir=url),
        parts=[(model, optimizer)], scheduler=scheduler, mesh=ParallelMesh.single(), global_batch=4,
        total_steps=100, identity={"config_hash": "abc", "data_version": "v1", "scheme": "ddp"})


@pytest.mark.slow
def test_the_manager_saves_to_s3_and_a_resume_skips_a_prefix_without_its_manifest(s3, tmp_path):
    """checkpoint.dir=s3://...: the worker's CheckpointManager (async saves) writes the bucket,
    nothing under RUN_DIR/checkpoints; a step whose manifest is gone (a save killed before its
    commit) is rejected on resume and the one before loads; retention holds in the bucket."""
    url = f"s3://{new_bucket()}/ckpts"
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    parts = make_parts(0)
    ckpt = run_manager(run, url, parts, keep=2)
    held = {}
    for step in (1, 2, 3):
        train_step(*parts)
        held[step] = params(parts[0])
        ckpt.save(step)
    ckpt.close()
    store = open_storage(url).child(run.path.name)
    assert [(s, ok) for s, _, ok in checkpoint_steps(store)] == [(2, True), (3, True)]  # keep=2
    assert not run.checkpoints.exists()
    store.fs.rm(f"{store.root}/step_00000003/{MANIFEST}")  # the commit undone: as if killed before it

    fresh = make_parts(99)
    again = run_manager(run, url, fresh)
    assert again.resume() == 2
    again.close()
    assert all(torch.equal(a, b) for a, b in zip(params(fresh[0]), held[2], strict=True))
    [rejected] = [e for e in run.events_list() if e["event"] == "checkpoint_rejected"]
    assert rejected["step"] == 3 and "no manifest" in rejected["reason"]
    assert rejected["path"] == f"{url}/run/step_00000003"


@pytest.mark.slow
def test_a_store_that_does_not_answer_is_an_oserror_for_the_driver_and_one_line_for_list(tmp_path, monkeypatch):
    """No server at the endpoint: the driver's lookup raises StoreUnreachable (an OSError, which
    the Slurm driver records as the run's failure) after its tries; `list` says one line."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries of a refused connection: seconds each
    run, store = make_run(tmp_path, "s3://no-such-server/team")
    with pytest.raises(StoreUnreachable, match="cannot list s3://no-such-server/team/r1"):
        latest_checkpoint_step(run, tries=1)
    ran = run_main("dtk.checkpoint", "list", str(run.path))
    assert ran.returncode == 2 and ran.stderr.count("\n") == 1, ran.stderr
    assert ran.stderr.startswith(f"error: RUN_DIR {run.path}: cannot list {store}")
    status = run_main("dtk.status", str(run.path))  # the rest of the run's state, the store's silence said
    assert status.returncode == 0, status.stderr
    assert "checkpoint   unknown: the checkpoint store did not answer" in status.stdout
    assert f"store        did not answer: cannot list {store}" in status.stdout


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_rollback_picks_and_removes_checkpoints_in_the_runs_store(where, request, tmp_path):
    """dtk.train.rollback.roll_back with the worker's CheckpointManager (real saves): the newest
    committed checkpoint before the first bad step is chosen from the store, the newer ones
    are removed there, and the run resumes from it. The data order and the divergence watch
    are stand-ins: what is tested is where the checkpoints are read and removed."""
    url = ""
    if where == "s3":
        request.getfixturevalue("s3")
        url = f"s3://{new_bucket()}/team"
    run = RunDir(tmp_path / "r1")
    run.path.mkdir()
    parts = make_parts(0)
    manager = run_manager(run, url, parts)
    for step in (1, 2, 3, 4):
        train_step(*parts)
        manager.save(step)
    manager.wait()
    store = manager.store
    assert committed_steps(store) == [1, 2, 3, 4]
    bad = [BadStep(step=s, cause="nonfinite_loss", batch_hash=f"h{s}", loss=float("nan")) for s in (3, 4)]
    batches = SimpleNamespace(data_step=lambda s: s, set_skips=lambda skips: None)
    trainer = SimpleNamespace(watch=SimpleNamespace(rollbacks_done=1, rolled_back=lambda step: None))
    assert roll_back(Rollback(bad), run, manager, batches, trainer, rank0=True) == 2
    manager.close()
    assert committed_steps(store) == [1, 2] and checkpoint_folder(store, 3).files() == []
    [event] = [e for e in run.events_list() if e["event"] == "rolled_back"]
    assert event["to_step"] == 2 and event["checkpoint"] == str(checkpoint_folder(store, 2))
    assert url == "" or not run.checkpoints.exists()
