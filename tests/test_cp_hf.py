"""Context parallelism of Hugging Face models (model=hf, dtk.models.hf) on 2 real gloo ranks:
a Llama with grouped-query attention and a Qwen2 (biased q/k/v projections), both with RoPE,
under cp=2 against the same model on one process: the step's loss and the gradients."""

from __future__ import annotations

import json
import traceback

import pytest
import torch
import torch.distributed as dist

from multirank import run_on_ranks

pytestmark = pytest.mark.dist
WORLD = 2
CONFIGS = {
    "llama": {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "qwen2": {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": True},
}


def _one(rank: int, size: int, folder: str) -> dict:
    from dtk.models.hf import build
    from dtk.parallel.cp import CpLayout, apply_cp
    from dtk.train.loss import TokenCrossEntropy
    from dtk.train.task import LmTask

    def fresh():
        torch.manual_seed(0)
        return build(config=folder, seq_len=32)

    tokens = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(1))
    off = torch.autocast("cpu", enabled=False)
    reference, model = fresh(), fresh()
    want = LmTask(TokenCrossEntropy())(reference, tokens, off)
    want.backward()
    layout = CpLayout(rank=rank, size=size, group=dist.group.WORLD)
    apply_cp(model, layout=layout)
    loss = LmTask(TokenCrossEntropy(), cp=layout)(model, tokens, off)
    loss.backward()
    diffs = {}
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        g = p.grad.clone()
        dist.all_reduce(g)
        diffs[name] = (g / size - r.grad).abs().max().item()
    return {"loss": loss.item(), "want": want.item(), "grads": diffs,
            "implementation": model.config._attn_implementation}


def _checks(rank: int, size: int, folders: dict[str, str]) -> dict:
    out = {}
    for name, folder in folders.items():
        try:
            out[name] = _one(rank, size, folder)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("cp_hf")
    folders = {}
    for name, config in CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        folders[name] = str(root / name)
    return run_on_ranks(_checks, WORLD, root, folders)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.slow
def test_hf_model_under_cp_gives_the_one_process_loss_and_gradients(results, name):
    for rank, r in enumerate(results):
        got = r[name]
        assert "error" not in got, f"rank {rank}:\n{got['error']}"
        assert got["implementation"] == "dtk_cp"
        assert got["loss"] == pytest.approx(got["want"], rel=1e-5)
        assert got["grads"] and max(got["grads"].values()) < 1e-5, got["grads"]
