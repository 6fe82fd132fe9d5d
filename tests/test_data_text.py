"""`python -m dtk.data prepare --tokenizer bytes|chars|DIR --val-fraction F`: real text as
users prepare it, with a real Hugging Face tokenizer trained and saved in the test."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import run_main
from dtk.config.schema import Hdf5DataConfig
from dtk.data.hdf5 import Hdf5Tokens, split
from dtk.data.prepare import prepare


@pytest.fixture
def corpus(tmp_path) -> Path:
    rng = random.Random(1)
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "caf\u00e9", "\n"]
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(6000)), encoding="utf-8")
    return path


@pytest.fixture
def bpe_dir(tmp_path, corpus) -> Path:
    """A byte-level BPE of 300 tokens trained on the corpus and saved as a tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                 show_progress=False))
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_chars_gives_one_id_per_distinct_character_and_reads_back_as_the_text(corpus, tmp_path):
    m = prepare(corpus, tmp_path / "d", seq_len=32, tokenizer="chars")
    text = corpus.read_text(encoding="utf-8")
    chars = sorted(set(text))
    assert m["tokenizer"] == "chars" and m["vocab_size"] == len(chars) and m["vocabulary"] == "".join(chars)
    rows = Hdf5Tokens(tmp_path / "d").get(np.arange(3))
    decoded = "".join(m["vocabulary"][i] for i in rows.reshape(-1))
    assert decoded == text[: 3 * 33]
    assert prepare(corpus, tmp_path / "again", seq_len=32, tokenizer="chars")["version"] == m["version"]
    assert prepare(corpus, tmp_path / "b", seq_len=32)["version"] != m["version"]  # bytes: another dataset


def test_a_local_hugging_face_tokenizer_folder_gives_its_ids_and_vocabulary(corpus, bpe_dir, tmp_path):
    from tokenizers import Tokenizer

    proc = run_main("dtk.data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "d"), "--seq-len", "16",
                    "--tokenizer", str(bpe_dir))
    assert proc.returncode == 0, proc.stderr
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    tok = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    assert m["tokenizer"] == "hf" and m["vocab_size"] == tok.get_vocab_size() > 256
    assert m["tokenizer_path"] == str(bpe_dir.resolve()) and f"model.vocab_size={m['vocab_size']}" in proc.stderr
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    want = [i for enc in tok.encode_batch(lines, add_special_tokens=False) for i in enc.ids]
    got = Hdf5Tokens(tmp_path / "d").get(np.arange(m["num_samples"])).reshape(-1)
    assert got.tolist() == want[: len(got)] and len(want) - len(got) < 17
    text = tok.decode(got[:40].tolist())
    assert len(text) > 40 and text == "".join(lines)[: len(text)]


def test_val_fraction_writes_the_end_of_the_corpus_as_the_validation_split_a_job_uses(corpus, tmp_path):
    m = prepare(corpus, tmp_path / "d", seq_len=32, tokenizer="chars", val_fraction=0.1, samples_per_shard=200)
    n = m["num_samples"]
    num_val = round(n * 0.1)
    assert m["val_samples"] == num_val and m["val_shards"] == ["val_00000.h5"]
    assert listing(tmp_path / "d") == sorted(["manifest.json", "val_00000.h5", *(s["file"] for s in m["shards"][:-1])])
    data = Hdf5Tokens(tmp_path / "d", verify=True)
    # The default config (data.val_fraction=0.05, no val_shards) takes the prepared split.
    cfg = Hdf5DataConfig(path=str(tmp_path / "d"))
    train, val = split(data, val_fraction=cfg.val_fraction, seed=cfg.split_seed, val_shards=cfg.val_shards)
    assert (len(train), len(val)) == (n - num_val, num_val)
    assert np.array_equal(val.get(np.arange(num_val)), data.get(np.arange(n - num_val, n)))
    # Named in the config, the same split.
    _, named = split(data, val_fraction=0.5, seed=3, val_shards=["val_00000.h5"])
    assert np.array_equal(named.indices, val.indices)
    # The same tokens split otherwise are another dataset version.
    assert prepare(corpus, tmp_path / "e", seq_len=32, tokenizer="chars", val_fraction=0.2)["version"] != m["version"]


def test_submit_checks_model_vocab_size_against_the_tokenizers_vocabulary(corpus, bpe_dir, tmp_path):
    assert run_main("dtk.data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "d"), "--seq-len", "16",
                    "--tokenizer", str(bpe_dir), "--val-fraction", "0.1").returncode == 0
    args = ["train.global_batch=8", "train.micro_batch=4", "model.seq_len=16", "data=hdf5", f"data.path={tmp_path / 'd'}",
            "train.steps=2", "submit.dry_run=true", f"run.root={tmp_path / 'runs'}"]
    proc = run_main("dtk.submit", *args, cwd=tmp_path)  # the built-in model's vocab_size: 256
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    vocab = json.loads((tmp_path / "d" / "manifest.json").read_text())["vocab_size"]
    assert proc.stderr.startswith("error: model.vocab_size=256") and f"({vocab} token ids)" in proc.stderr
    assert run_main("dtk.submit", *args, f"model.vocab_size={vocab}", cwd=tmp_path).returncode == 0
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--val-fraction", "0"], "error: --val-fraction 0.0: expected a fraction"),
    (["--val-fraction", "1"], "error: --val-fraction 1.0: expected a fraction"),
    (["--val-fraction", "-0.5"], "error: --val-fraction -0.5"),
    (["--val-fraction", "0.99999"], "error: --val-fraction 0.99999: of"),
    (["--tokenizer", "words"], "error: --tokenizer words: not bytes, chars, or an existing folder"),
    (["--tokenizer", "MISSING"], "error: --tokenizer MISSING: not bytes, chars"),
    (["--tokenizer", "EMPTY"], "error: --tokenizer EMPTY: the folder holds no tokenizer.json"),
    (["--tokenizer", "BROKEN"], "error: --tokenizer BROKEN: tokenizer.json does not load"),
])
def test_bad_tokenizer_or_fraction_is_one_error_line_and_writes_nothing(extra, needle, corpus, tmp_path):
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "BROKEN").mkdir()
    (tmp_path / "BROKEN" / "tokenizer.json").write_text("{not json")
    extra = [str(tmp_path / e) if e in ("MISSING", "EMPTY", "BROKEN") else e for e in extra]
    needle = needle.replace("MISSING", str(tmp_path / "MISSING")).replace("EMPTY", str(tmp_path / "EMPTY"))
    needle = needle.replace("BROKEN", str(tmp_path / "BROKEN"))
    before = listing(tmp_path)
    proc = run_main("dtk.data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "d"), "--seq-len", "16",
                    *extra, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(needle), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert listing(tmp_path) == before  # no dataset, no temporary folder


def test_a_tokenizer_for_token_ids_is_refused(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(200))
    proc = run_main("dtk.data", "prepare", "--input", str(tmp_path / "t.npy"), "--out", str(tmp_path / "d"),
                    "--tokenizer", "chars")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --tokenizer chars: the input is .npy token ids")
    assert not (tmp_path / "d").exists()
