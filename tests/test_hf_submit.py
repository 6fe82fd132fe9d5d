"""model=hf on the login node: the vocabulary and the longest sample come from config.json,
read without torch or transformers, and a sample too long or token ids too many are refused
at submission, not found on the workers."""

from __future__ import annotations

import json

import pytest

from conftest import dtk
from dtk.common.errors import UserError
from dtk.config.compose import compose
from dtk.plan.plan import make_plan


@pytest.fixture
def tiny(tmp_path):
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}))
    return folder


def test_generated_data_takes_the_vocabulary_of_config_json(tiny, tmp_path):
    cfg = compose(["model=hf", f"model.config={tiny}", "model.seq_len=32", f"run.root={tmp_path}"])
    assert cfg.model.vocab_size == 128
    make_plan(cfg)
    given = compose(["model=hf", f"model.config={tiny}", "model.seq_len=32", "model.vocab_size=100"])
    assert given.model.vocab_size == 100
    overridden = compose(["model=hf", f"model.config={tiny}", "model.seq_len=32", "+model.config_overrides={vocab_size: 96}"])
    assert overridden.model.vocab_size == 96


@pytest.mark.parametrize("keys, says", [
    (["model.seq_len=128"], "error: model.seq_len=128 is longer than the model's max_position_embeddings=64 (config.json);"
                            " use model.seq_len <= 64"),
    (["model.seq_len=32", "model.vocab_size=512"], "error: model.vocab_size=512: the data's token ids must fit the"
                                                  " model's vocabulary of 128 (config.json)"),
])
def test_a_sample_too_long_or_a_vocabulary_too_large_is_refused_at_submission_without_torch(tiny, tmp_path, keys, says):
    code = ("import sys; from dtk.common.errors import run_cli; from dtk.plan.__main__ import main;"
            " import atexit; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr)); run_cli(main)")
    proc = dtk("-c", code, "model=hf", f"model.config={tiny}", *keys, f"run.root={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    line, imported = proc.stderr.strip().splitlines()
    assert line.startswith(says) and imported == "False"


def test_model_hf_without_a_config_json_is_refused_at_submission(tmp_path):
    with pytest.raises(UserError, match=f"model.config={tmp_path}: no config.json in that folder"):
        make_plan(compose(["model=hf", f"model.config={tmp_path}", "model.vocab_size=8"]))
