"""Checkpoints in one process: commit protocol, verification, rejection, retention, async
staging, identity checks, and the `python -m dtk.checkpoint` commands."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import dtk, run_main
from dtk.checkpoint import manifest as mf
from dtk.checkpoint.manager import CheckpointManager
from dtk.checkpoint.retention import doomed
from dtk.common.errors import UserError
from dtk.common.rundir import RunDir
from dtk.common.storage import checkpoint_steps, checkpoints_of
from dtk.config.schema import CheckpointConfig
from dtk.mesh.mesh import ParallelMesh

# One process without a process group: DCP says it assumes a single process, which it is.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_parts(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> None:
    x = torch.randn(4, 8)
    model(x).square().mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def manager(run: RunDir, model, optimizer, scheduler, *, asynchronous=True, keep=10, data_version="v1", every=1):
    return CheckpointManager(
        run,
        checkpoint=CheckpointConfig(every=every, keep=keep, async_save=asynchronous),
        parts=[(model, optimizer)],
        scheduler=scheduler,
        mesh=ParallelMesh.single(),
        global_batch=4,
        total_steps=100,
        identity={"config_hash": "abc", "data_version": data_version, "scheme": "ddp"},
    )


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def save_three(folder: Path, *, asynchronous: bool = True) -> tuple[RunDir, dict[int, list[torch.Tensor]]]:
    """A run with checkpoints at steps 1, 2, 3 and the parameters each holds. A synchronous
    save is committed (manifest and event) by the time `save` returns."""
    run = RunDir(folder)
    run.path.mkdir()
    model, optimizer, scheduler = make_parts()
    ckpt = manager(run, model, optimizer, scheduler, asynchronous=asynchronous)
    held = {}
    for step in (1, 2, 3):
        train_step(model, optimizer, scheduler)
        held[step] = params(model)
        ckpt.save(step)
        if not asynchronous:
            assert (run.checkpoint_dir(step) / "manifest.json").is_file() and not ckpt.saving
            last = events(run, "checkpoint_saved")[-1]
            assert (last["step"], last["asynchronous"]) == (step, False)
    ckpt.close()
    return run, held


@pytest.fixture
def saved(tmp_path) -> tuple[RunDir, dict[int, list[torch.Tensor]]]:
    return save_three(tmp_path / "run")


def events(run: RunDir, name: str) -> list[dict]:
    return [e for e in run.events_list() if e["event"] == name]


def resume_fresh(run: RunDir, **kw):
    model, optimizer, scheduler = make_parts(seed=99)
    ckpt = manager(run, model, optimizer, scheduler, **kw)
    step = ckpt.resume()
    ckpt.close()
    return step, model


def test_manifest_is_written_last_and_lists_every_file_with_size_and_checksum(tmp_path, monkeypatch):
    # At the moment of the commit, every other file must already be there, complete (its
    # final size and checksum), and nothing may be written into the folder after it.
    at_commit: dict[str, dict] = {}
    commit = mf.commit

    def spy(folder: Path, manifest: dict) -> None:
        assert not (folder / "manifest.json").exists()
        at_commit[folder.name] = {p.name: mf.describe_file(p) for p in folder.iterdir()}
        commit(folder, manifest)

    monkeypatch.setattr(mf, "commit", spy)
    run, _ = save_three(tmp_path / "run")
    folder = run.checkpoint_dir(3)
    manifest = json.loads((folder / "manifest.json").read_text())
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        assert entry["size"] == (folder / name).stat().st_size
        assert entry["crc32"] == mf.file_checksum(folder / name)
    for key in ("step", "world_size", "global_batch", "config_hash", "data_version", "samples_consumed", "rng_files"):
        assert key in manifest, key
    assert manifest["step"] == 3 and manifest["samples_consumed"] == 12
    assert at_commit[folder.name] == manifest["files"]  # complete before the commit, untouched after
    assert [e["step"] for e in events(run, "checkpoint_saved")] == [1, 2, 3]


def test_async_save_holds_the_state_at_save_time_not_later(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    model, optimizer, scheduler = make_parts()
    ckpt = manager(run, model, optimizer, scheduler, asynchronous=True)
    train_step(model, optimizer, scheduler)
    at_save = params(model)
    ckpt.save(1)
    train_step(model, optimizer, scheduler)  # training goes on while the state is copied and written
    assert not all(torch.equal(a, b) for a, b in zip(params(model), at_save, strict=True))
    ckpt.close()
    step, fresh = resume_fresh(run)
    assert step == 1
    for a, b in zip(params(fresh), at_save, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_resume_loads_the_newest_checkpoint_exactly(tmp_path, asynchronous):
    run, held = save_three(tmp_path / "run", asynchronous=asynchronous)
    assert {e["asynchronous"] for e in events(run, "checkpoint_saved")} == {asynchronous}
    step, model = resume_fresh(run, asynchronous=asynchronous)
    assert step == 3
    assert all(torch.equal(a, b) for a, b in zip(params(model), held[3], strict=True))
    (loaded,) = events(run, "checkpoint_loaded")
    assert loaded["verify_seconds"] > 0 and loaded["load_seconds"] > 0  # where a slow start went
    assert loaded["verify_seconds"] + loaded["load_seconds"] <= loaded["seconds"] + 0.002


@pytest.mark.parametrize("restore", [True, False], ids=["restored", "restore-disabled"])
def test_resume_restores_the_random_stream(tmp_path, monkeypatch, restore):
    """After a resume the next random draw (a dropout mask, data noise) is the one the
    uninterrupted run makes; with the restore disabled it is not - what makes the end-to-end
    bitwise-resume tests (model.dropout > 0) fail when the RNG is not restored."""
    from dtk.checkpoint import load as loading

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    model, optimizer, scheduler = make_parts()
    ckpt = manager(run, model, optimizer, scheduler)
    torch.manual_seed(7)
    train_step(model, optimizer, scheduler)
    ckpt.save(1)
    ckpt.close()
    uninterrupted = torch.rand(8)
    if not restore:
        monkeypatch.setattr(loading, "set_rng_state", lambda state: None)
    torch.manual_seed(123)  # a fresh start seeds its own stream before resuming
    model, optimizer, scheduler = make_parts(seed=99)
    again = manager(run, model, optimizer, scheduler)
    assert again.resume() == 1
    again.close()
    assert torch.equal(torch.rand(8), uninterrupted) == restore


def corrupt_truncate(folder: Path) -> None:
    shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])


def corrupt_flip(folder: Path) -> None:
    shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def corrupt_manifest(folder: Path) -> None:
    (folder / "manifest.json").unlink()


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [(corrupt_truncate, "bytes, manifest says"), (corrupt_flip, "crc32"), (corrupt_manifest, "no manifest.json")],
)
def test_a_corrupt_newest_checkpoint_is_rejected_and_the_previous_one_loads(saved, corrupt, reason):
    run, held = saved
    corrupt(run.checkpoint_dir(3))
    with pytest.raises(mf.Rejected, match=reason.split(",")[0]):
        mf.verify(run.checkpoint_dir(3))
    step, model = resume_fresh(run)
    assert step == 2
    assert all(torch.equal(a, b) for a, b in zip(params(model), held[2], strict=True))
    rejected = events(run, "checkpoint_rejected")
    assert [e["step"] for e in rejected] == [3]
    assert reason in rejected[0]["reason"]
    assert events(run, "checkpoint_loaded")[-1]["step"] == 2


def test_when_checkpoints_exist_but_none_verifies_the_job_stops(saved):
    run, _ = saved
    for step in (1, 2, 3):
        corrupt_flip(run.checkpoint_dir(step))
    with pytest.raises(UserError, match="none verifies"):
        resume_fresh(run)
    assert [e["step"] for e in events(run, "checkpoint_rejected")] == [3, 2, 1]


def test_only_an_unfinished_save_means_a_fresh_start(tmp_path):
    run = RunDir(tmp_path / "run")
    run.checkpoint_dir(5).mkdir(parents=True)  # a first save killed before its manifest
    step, _ = resume_fresh(run)
    assert step == 0
    assert events(run, "checkpoint_rejected")[0]["step"] == 5


def test_resuming_on_another_dataset_version_is_an_error(saved):
    run, _ = saved
    with pytest.raises(UserError, match="data_version.*dataset changed"):
        resume_fresh(run, data_version="v2")


def test_the_next_save_of_a_killed_step_replaces_its_folder(saved):
    run, _ = saved
    stale = run.checkpoint_dir(4)
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half written")
    model, optimizer, scheduler = make_parts()
    ckpt = manager(run, model, optimizer, scheduler)
    assert ckpt.resume() == 3
    ckpt.save(4)
    ckpt.close()
    assert mf.verify(stale)["step"] == 4


def test_retention_keeps_the_newest_and_drops_killed_saves_and_abandoned_futures():
    p = Path
    found = [(s, p(f"step_{s}"), ok) for s, ok in [(10, True), (15, False), (20, True), (30, True), (40, True), (50, False)]]
    # After committing 30 on a timeline resumed from 20 (40 was rejected, 50 a killed save):
    gone = doomed(found, keep=2, current_step=30, protect=[30])
    assert gone == [p("step_10"), p("step_15"), p("step_40"), p("step_50")]
    # keep=1 never deletes the step just committed (the newest verified one), even if a
    # corrupt newer folder exists.
    assert p("step_30") not in doomed(found, keep=1, current_step=30, protect=[30])
    # A protected older step survives the count rule.
    assert p("step_10") not in doomed(found, keep=1, current_step=30, protect=[10, 30])


def test_retention_in_a_run_keeps_checkpoint_keep(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    model, optimizer, scheduler = make_parts()
    ckpt = manager(run, model, optimizer, scheduler, keep=2)
    for step in range(1, 6):
        train_step(model, optimizer, scheduler)
        ckpt.save(step)
    ckpt.close()
    assert [s for s, _, ok in checkpoint_steps(checkpoints_of(run)) if ok] == [4, 5]


def test_list_command_imports_no_torch_and_reports_verification(saved):
    run, _ = saved
    corrupt_flip(run.checkpoint_dir(2))
    code = (
        "import sys, runpy; sys.modules['torch'] = None; "
        f"sys.argv = ['dtk.checkpoint', 'list', {str(run.path)!r}]; runpy.run_module('dtk.checkpoint', run_name='__main__')"
    )
    proc = dtk("-c", code)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["step", "size", "world", "verified"]
    rows = {int(line.split()[0]): line for line in lines[1:]}
    assert rows[1].endswith("yes") and rows[3].endswith("yes")
    assert "NO:" in rows[2] and "crc32" in rows[2]


def test_cli_errors_are_one_line(tmp_path):
    proc = run_main("dtk.checkpoint", "list", str(tmp_path / "nope"))
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and len(proc.stderr.splitlines()) == 1
    proc = run_main("dtk.checkpoint", "export", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "--out" in proc.stderr
    assert run_main("dtk.checkpoint", "--help").returncode == 0


def test_export_writes_a_plain_state_dict(saved, tmp_path):
    run, held = saved
    shutil.rmtree(run.checkpoint_dir(3))
    proc = run_main("dtk.checkpoint", "export", str(run.path), "--out", str(tmp_path / "m.pt"))
    assert proc.returncode == 0, proc.stderr
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    model, _, _ = make_parts(seed=5)
    model.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(params(model), held[2], strict=True))
    assert json.loads((tmp_path / "m.pt.json").read_text())["step"] == 2


def test_minutes_interval_saves_when_the_time_has_come(tmp_path, monkeypatch):
    # The manager's clock is advanced by hand: a loaded machine must not decide the outcome.
    from dtk.checkpoint import manager as manager_module

    now = [1000.0]
    monkeypatch.setattr(manager_module, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter))
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    model, optimizer, scheduler = make_parts()
    ckpt = CheckpointManager(
        run,
        checkpoint=CheckpointConfig(every=0, keep=5, async_save=True, every_minutes=0.001),  # 60 ms
        parts=[(model, optimizer)], scheduler=scheduler, mesh=ParallelMesh.single(), global_batch=4, total_steps=100,
        identity={"config_hash": "abc", "data_version": "v1", "scheme": "ddp"},
    )
    ckpt.after_step(1)
    assert not checkpoint_steps(checkpoints_of(run))  # not yet: the clock starts at construction
    now[0] += 0.08
    ckpt.after_step(2)
    now[0] += 0.03
    ckpt.after_step(3)  # the clock restarted at the save of step 2
    ckpt.close()
    assert [s for s, _, ok in checkpoint_steps(checkpoints_of(run)) if ok] == [2]


def test_a_save_checksums_its_shards_while_writing_them_not_by_reading_them_back(tmp_path, monkeypatch):
    """One pass over the data: only the small files written outside DCP (RNG states,
    trainer.json) are read back for their checksum; the manifest still matches every file."""
    read_back: list[str] = []
    describe = mf.describe_file

    def spy(path: Path) -> dict:
        read_back.append(path.name)
        return describe(path)

    monkeypatch.setattr(mf, "describe_file", spy)
    run, _ = save_three(tmp_path / "run", asynchronous=False)
    assert sorted(set(read_back)) == ["rng_00000.pt", "trainer.json"]
    folder = run.checkpoint_dir(3)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {".metadata", "__0_0.distcp"} <= set(manifest["files"])
    assert mf.verify(folder)["step"] == 3  # sizes and CRCs of every file, read back here


def test_a_file_written_out_of_order_is_not_trusted_to_its_running_checksum(tmp_path):
    from dtk.checkpoint.hashing import CHUNK, HashingFileSystem

    fs = HashingFileSystem()
    with fs.create_stream(tmp_path / "straight", "wb") as stream:
        stream.write(b"abc")
        stream.write(memoryview(bytearray(b"defg")))
    with fs.create_stream(tmp_path / "large", "wb") as stream:  # whole CHUNKs hashed in parallel, then joined
        stream.write(b"header")
        stream.write(torch.arange(2 * CHUNK // 4 + 3, dtype=torch.float32).numpy().tobytes())
        stream.write(b"trailer")
    with fs.create_stream(tmp_path / "rewound", "wb") as stream:
        stream.write(b"abc")
        stream.seek(0)
        stream.write(b"x")
    fs.rename(tmp_path / "straight", tmp_path / "renamed")
    hashed = fs.hashed()
    assert hashed == {"renamed": mf.describe_file(tmp_path / "renamed"), "large": mf.describe_file(tmp_path / "large")}
    assert hashed["renamed"]["size"] == 7


def test_a_large_file_is_handed_to_the_disk_as_it_is_written_not_only_at_its_fsync(tmp_path, monkeypatch):
    import os

    from dtk.checkpoint import hashing

    kicked: list[tuple[int, int]] = []

    def record(fd, start, length, flags):  # only this file's: another test's save may still be writing
        if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "big"):
            kicked.append((start, length))

    monkeypatch.setattr(hashing, "_SYNC_FILE_RANGE", record)
    fs = hashing.HashingFileSystem()
    with fs.create_stream(tmp_path / "big", "wb") as stream:
        for _ in range(3):
            stream.write(bytes(hashing.CHUNK))
        stream.write(b"tail")  # small: left to the fsync
    assert kicked == [(i * hashing.CHUNK, hashing.CHUNK) for i in range(3)]
    assert fs.hashed()["big"] == mf.describe_file(tmp_path / "big")
