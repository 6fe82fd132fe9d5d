"""A Hugging Face mixture of experts (Mixtral, tiny config) trains under model=hf with FSDP on
two gloo ranks, and `python -m dtk.checkpoint export --format hf` of it loads with
`from_pretrained`: the same tensors as the checkpoint, a model that runs. (Expert
parallelism is the built-in model's: scheme.ep with model=hf is refused, tests/test_moe.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import dtk

pytestmark = [pytest.mark.slow, pytest.mark.dist]

MIXTRAL = {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
           "tie_word_embeddings": False}


def test_a_mixtral_trained_by_config_exports_for_from_pretrained(tmp_path: Path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from dtk.checkpoint.export import load_model_state
    from dtk.checkpoint.manifest import verify

    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(MIXTRAL))
    proc = dtk("dtk.submit", "model=hf", f"model.config={tmp_path}/mixtral", "model.seq_len=32", "tasks_per_node=2",
               "+scheme=fsdp", "train.steps=4", "train.global_batch=8", f"run.root={tmp_path}", "run.name=run",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and losses[-1] < losses[0]
    proc = dtk("dtk.checkpoint", "export", str(run), "--format", "hf", "--out", str(tmp_path / "hf"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "MixtralForCausalLM"
    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    saved, loaded = load_model_state(last, verify(last)), model.state_dict()
    assert saved.keys() == loaded.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor.to(loaded[name].dtype), loaded[name]), name
    logits = model(torch.randint(0, 128, (2, 32))).logits
    assert logits.shape == (2, 32, 128) and torch.isfinite(logits).all()
