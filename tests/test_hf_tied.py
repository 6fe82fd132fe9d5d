"""A tiny Hugging Face Llama with `tie_word_embeddings: true` (as Llama-3.2-1B and
Qwen2-0.5B have it) trained with `python -m dtk.submit model=hf` under tp on 2 processes:
the checkpoint holds the tied weight once, and `checkpoint export --format hf` writes a
folder whose `from_pretrained` model has one tensor for its head and its embedding, with
the trained values, and computes dtk's logits.

Tolerance: from_pretrained's logits within 1e-5 of dtk's model holding the same weights
(tests/test_hf_train.py's: the same class and kernels).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from test_schemes import final_parameters

from conftest import dtk, require

pytestmark = [pytest.mark.slow, pytest.mark.dist]

SEQ_LEN, VOCAB = 16, 64
JOB = [f"model.seq_len={SEQ_LEN}", f"model.vocab_size={VOCAB}", "data.num_samples=128", "train.steps=3",
       "train.global_batch=8", "optim.warmup_steps=1", "checkpoint.every=3", "train.log_every=1000"]


def test_a_tied_model_exports_to_from_pretrained_with_one_trained_tensor(tmp_path):
    require(
        importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("safetensors") is not None,
        "transformers and safetensors are not installed (pip install '.[hf]')",
    )
    from transformers import AutoConfig, AutoModelForCausalLM

    from dtk.config.convert import model_config
    from dtk.models.build import build_model

    AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
    ).save_pretrained(tmp_path / "tiny")
    proc = dtk("dtk.submit", "model=hf", f"model.config={tmp_path / 'tiny'}", *JOB, "+scheme=tp", "tasks_per_node=2",
               f"run.root={tmp_path}", "run.name=run", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = tmp_path / "run"
    trained = final_parameters(run)
    assert "lm_head.weight" not in trained  # the tie is one tensor in the checkpoint
    embedding = trained["model.embed_tokens.weight"]

    proc = dtk("dtk.checkpoint", "export", str(run), "--format", "hf", "--out", str(tmp_path / "exported"))
    assert proc.returncode == 0, proc.stderr
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"), dtype=torch.float32)
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    assert theirs.lm_head.weight.detach().equal(embedding)

    # dtk's own model (model=hf's factory) from the torch export: both names load the tensor.
    proc = dtk("dtk.checkpoint", "export", str(run), "--out", str(tmp_path / "state.pt"))
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "state.pt.json").read_text())
    assert info["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    ours = build_model(model_config(info["model"]), device="cpu", seed=0)
    ours.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ours.eval(), theirs.eval()
    rows = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(rows) - theirs(rows).logits).abs().max().item()
    assert diff <= 1e-5
