"""Data: the world-size-invariant order, the loader, HDF5 datasets and `python -m dtk.data`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_main
from dtk.common.errors import UserError
from dtk.config.schema import Hdf5DataConfig, ModelConfig
from dtk.data.hdf5 import Hdf5Tokens, split
from dtk.data.loader import StepBatches, build_splits
from dtk.data.order import GlobalOrder, rank_share
from dtk.data.prepare import prepare
from dtk.data.synthetic import SyntheticTokens


def epoch_ids(num_samples: int, global_batch: int, dp_size: int, seed: int) -> list[np.ndarray]:
    """Per step, what the ranks take together (rank 0's share first), for one epoch's
    worth of stream positions (the last batch may reach into the next epoch)."""
    order = GlobalOrder(num_samples, seed)
    steps = -(-num_samples // global_batch)
    out = []
    for step in range(steps):
        batch = order.global_batch(step, global_batch)
        out.append(np.concatenate([rank_share(batch, r, dp_size) for r in range(dp_size)]))
    return out


def test_every_sample_exactly_once_per_epoch_for_1_to_8_ranks():
    """Property over random sizes: for each data-parallel size D in 1..8 that divides the
    global batch, the ranks' shares over an epoch hold every sample exactly once, and the
    global batches equal those of one rank (no duplicates, no gaps, same order)."""
    rng = random.Random(7)
    cases = 0
    for _ in range(60):
        global_batch = rng.choice([8, 12, 16, 24, 40, 48, 56, 64, 120])
        num_samples = rng.randint(1, 12) * global_batch + rng.choice([0, 0, rng.randint(1, global_batch - 1)])
        seed = rng.randint(0, 10_000)
        single = epoch_ids(num_samples, global_batch, 1, seed)
        for dp in range(1, 9):
            if global_batch % dp:
                continue
            per_step = epoch_ids(num_samples, global_batch, dp, seed)
            assert all(np.array_equal(a, b) for a, b in zip(per_step, single, strict=True))
            shares = [rank_share(GlobalOrder(num_samples, seed).global_batch(s, global_batch), r, dp)
                      for s in range(len(per_step)) for r in range(dp)]
            assert {len(x) for x in shares} == {global_batch // dp}
            stream = np.concatenate(per_step)[:num_samples]  # the epoch's positions
            assert np.array_equal(np.sort(stream), np.arange(num_samples))
            cases += 1
    assert cases > 200


def test_a_new_epoch_is_a_new_permutation_of_the_same_samples():
    order = GlobalOrder(50, seed=3)
    e0, e1 = order.ids(0, 50), order.ids(50, 50)
    assert not np.array_equal(e0, e1)
    assert np.array_equal(np.sort(e0), np.sort(e1))
    assert np.array_equal(GlobalOrder(50, seed=3).ids(37, 40), np.concatenate([e0[37:], e1[:27]]))


def test_a_batch_that_does_not_split_is_an_error():
    with pytest.raises(ValueError, match="does not split over 3"):
        rank_share(np.arange(8), 0, 3)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_step_batches_read_ahead_give_the_same_rows_as_direct_reads(dp_size):
    data = SyntheticTokens(num_samples=200, seq_len=16, vocab_size=64, seed=1, branching=3)
    order = GlobalOrder(len(data), seed=5)
    for rank in range(dp_size):
        batches = StepBatches(data, seed=5, global_batch=16, micro_batch=2, dp_rank=rank, dp_size=dp_size,
                              device=torch.device("cpu"))
        for step in [0, 1, 2, 7, 8, 30, 3]:  # in order, skipping ahead, and back (a restart)
            got = torch.cat(batches.get(step))
            want = data.get(rank_share(order.global_batch(step, 16), rank, dp_size))
            assert np.array_equal(got.numpy(), want)
        batches.close()


def test_synthetic_validation_is_held_out_and_fixed():
    data = SyntheticTokens(num_samples=64, seq_len=32, vocab_size=256, seed=2, branching=4)
    val = data.validation(16)
    assert len(val) == 16 and np.array_equal(val.tokens, data.validation(16).tokens)
    assert not any((row == data.tokens).all(axis=1).any() for row in val.tokens)


# --- datasets on disk -------------------------------------------------------------------


@pytest.fixture
def text_file(tmp_path) -> Path:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "ünïcode", "\n"]
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(4000)), encoding="utf-8")
    return path


def test_prepare_text_twice_gives_the_same_version_and_bytes(text_file, tmp_path):
    a = prepare(text_file, tmp_path / "a", seq_len=32, samples_per_shard=100)
    b = prepare(text_file, tmp_path / "b", seq_len=32, samples_per_shard=100)
    assert a == b  # manifests, shard checksums included: the files are byte-identical
    assert a["tokenizer"] == "bytes" and a["vocab_size"] == 256 and a["dtype"] == "uint8"
    assert len(a["shards"]) > 1 and sum(s["num_samples"] for s in a["shards"]) == a["num_samples"]
    data = Hdf5Tokens(tmp_path / "a", verify=True)
    raw = np.frombuffer(text_file.read_bytes(), dtype=np.uint8)
    ids = np.array([5, 0, a["num_samples"] - 1, 150, 5])
    want = np.stack([raw[i * 33 : (i + 1) * 33] for i in ids]).astype(np.int64)
    assert np.array_equal(data.get(ids), want)
    other = prepare(text_file, tmp_path / "c", seq_len=16)
    assert other["version"] != a["version"]


def test_an_npy_dataset_is_what_submit_accepts_with_its_version(tmp_path):
    """An .npy input ends as the same HDF5 dataset as a text one: submit checks it against the
    model and plans it (the text dataset's real training run is tests/test_data_train.py)."""
    tokens = np.random.default_rng(0).integers(0, 200, size=33 * 400).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    made = run_main("dtk.data", "prepare", "--input", str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "data"),
                    "--seq-len", "32")
    assert made.returncode == 0, made.stderr
    data = Hdf5Tokens(tmp_path / "data", verify=True)
    assert made.stdout.strip() == data.version and np.array_equal(data.get(np.array([1])), tokens[33:66][None])
    proc = run_main("dtk.submit", "train.global_batch=32", "train.micro_batch=8", "model.seq_len=32", "data=hdf5",
                    f"data.path={tmp_path / 'data'}", "train.steps=4", "submit.dry_run=true",
                    f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_prepare_npy_streams_and_rows(tmp_path):
    stream = np.random.default_rng(0).integers(0, 1000, size=5000)
    np.save(tmp_path / "stream.npy", stream)
    m = prepare(tmp_path / "stream.npy", tmp_path / "s", seq_len=49)
    assert m["num_samples"] == 100 and m["dtype"] == "uint16" and m["vocab_size"] == int(stream.max()) + 1
    assert np.array_equal(Hdf5Tokens(tmp_path / "s").get(np.array([3])), stream[150:200][None])
    rows = stream.reshape(100, 50)
    np.save(tmp_path / "rows.npy", rows)
    assert prepare(tmp_path / "rows.npy", tmp_path / "r")["version"] == m["version"]


def test_prepare_cli_prints_the_version_and_errors_are_one_line(text_file, tmp_path):
    proc = run_main("dtk.data", "prepare", "--input", str(text_file), "--out", str(tmp_path / "d"), "--seq-len", "32")
    assert proc.returncode == 0, proc.stderr
    version = proc.stdout.strip()
    assert version == json.loads((tmp_path / "d" / "manifest.json").read_text())["version"]
    again = run_main("dtk.data", "prepare", "--input", str(text_file), "--out", str(tmp_path / "d"), "--seq-len", "32")
    assert again.returncode == 2 and again.stderr.startswith("error: --out") and "--force" in again.stderr
    forced = run_main("dtk.data", "prepare", "--input", str(text_file), "--out", str(tmp_path / "d"), "--seq-len", "32",
                 "--force")
    assert forced.returncode == 0 and forced.stdout.strip() == version
    np.save(tmp_path / "f.npy", np.ones(100, dtype=np.float32))
    for args in (["--input", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x")],
                 ["--input", str(tmp_path / "f.npy"), "--out", str(tmp_path / "x")],
                 ["--out", str(tmp_path / "x")]):
        proc = run_main("dtk.data", "prepare", *args)
        assert proc.returncode == 2, args
        assert proc.stderr.startswith("error:") and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert run_main("dtk.data", "verify", str(tmp_path / "d")).returncode == 0


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes), to prove nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def prepare_cli(text_file: Path, out: Path, *extra: str):
    return run_main("dtk.data", "prepare", "--input", str(text_file), "--out", str(out), "--seq-len", "32", *extra)


def test_force_never_replaces_a_folder_of_the_users_files(text_file, tmp_path):
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "thesis.tex").write_text("three years of work\n")
    (mine / "notes" / "a.txt").write_text("a\n")
    (mine / "manifest.json").write_text('{"not": "a dataset"}\n')  # a manifest.json of something else
    before = snapshot(mine)
    proc = prepare_cli(text_file, mine, "--force")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --out") and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "no dtk dataset manifest.json" in proc.stderr
    assert snapshot(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "mine"]  # no half-built folder beside it


def test_force_replaces_a_dataset_but_not_a_dataset_holding_other_files(text_file, tmp_path):
    data = tmp_path / "d"
    first = prepare_cli(text_file, data, "--samples-per-shard", "100")
    assert first.returncode == 0, first.stderr
    (data / "README.txt").write_text("my notes about this corpus\n")
    before = snapshot(data)
    refused = prepare_cli(text_file, data, "--force")
    assert refused.returncode == 2 and refused.stderr.startswith("error: --out"), refused.stderr
    assert "README.txt" in refused.stderr
    assert snapshot(data) == before
    (data / "README.txt").unlink()
    link = tmp_path / "link"
    link.symlink_to(data)
    replaced = prepare_cli(text_file, link, "--force")  # a link: the dataset is replaced where it lives
    assert replaced.returncode == 0, replaced.stderr
    assert link.is_symlink() and len(json.loads((data / "manifest.json").read_text())["shards"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "d", "link"]
    a_file = tmp_path / "corpus.txt"
    as_file = prepare_cli(text_file, a_file, "--force")
    assert as_file.returncode == 2 and "is not a folder" in as_file.stderr
    assert a_file.read_bytes() == text_file.read_bytes()


def test_a_damaged_dataset_is_refused(text_file, tmp_path):
    prepare(text_file, tmp_path / "d", seq_len=32, samples_per_shard=100)
    shard = tmp_path / "d" / "shard_00001.h5"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    Hdf5Tokens(tmp_path / "d")  # sizes still match
    with pytest.raises(UserError, match="shard_00001.h5 does not match its crc32"):
        Hdf5Tokens(tmp_path / "d", verify=True)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(UserError, match="shard_00001.h5 has"):
        Hdf5Tokens(tmp_path / "d")
    with pytest.raises(UserError, match="no manifest.json"):
        Hdf5Tokens(tmp_path)


def test_the_split_is_fixed_disjoint_and_complete(text_file, tmp_path):
    prepare(text_file, tmp_path / "d", seq_len=32, samples_per_shard=100)
    data = Hdf5Tokens(tmp_path / "d")
    train, val = split(data, val_fraction=0.1, seed=4, val_shards=[])
    train2, val2 = split(Hdf5Tokens(tmp_path / "d"), val_fraction=0.1, seed=4, val_shards=[])
    assert np.array_equal(val.indices, val2.indices) and np.array_equal(train.indices, train2.indices)
    assert len(val) == round(0.1 * len(data))
    assert np.array_equal(np.sort(np.concatenate([train.indices, val.indices])), np.arange(len(data)))
    _, other = split(data, val_fraction=0.1, seed=5, val_shards=[])
    assert not np.array_equal(other.indices, val.indices)
    train, val = split(data, val_fraction=0.5, seed=4, val_shards=["shard_00000.h5"])
    assert np.array_equal(val.indices, np.arange(100))
    assert np.array_equal(val.get(np.array([0, 99])), data.get(np.array([0, 99])))
    with pytest.raises(UserError, match="no shard nope.h5"):
        split(data, val_fraction=0, seed=0, val_shards=["nope.h5"])


def test_the_model_must_fit_the_dataset(text_file, tmp_path):
    prepare(text_file, tmp_path / "d", seq_len=32)
    cfg = Hdf5DataConfig(path=str(tmp_path / "d"))

    def model(seq_len: int, vocab_size: int) -> ModelConfig:
        return ModelConfig(_target_="dtk.models.transformer.build", kwargs={"seq_len": seq_len, "vocab_size": vocab_size})

    train, val = build_splits(cfg, model=model(32, 256))
    assert len(train) + len(val) == Hdf5Tokens(tmp_path / "d").manifest["num_samples"]
    with pytest.raises(UserError, match="model.seq_len=64"):
        build_splits(cfg, model=model(64, 256))
    with pytest.raises(UserError, match="model.vocab_size=100"):
        build_splits(cfg, model=model(32, 100))
