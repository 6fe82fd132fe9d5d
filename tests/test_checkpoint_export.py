"""`python -m dtk.checkpoint export` of a 2-rank DDP run: the file loads into the plain
built-in model on one process and gives the loss the distributed model logged."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import dtk, require
from dtk.common.rundir import RunDir
from dtk.config.convert import model_config
from dtk.data.order import GlobalOrder
from dtk.data.synthetic import SyntheticTokens
from dtk.models.transformer import build
from dtk.plan.plan import Plan

pytestmark = [pytest.mark.slow, pytest.mark.dist]

# One batch through the same weights and samples: the distributed loss is the mean over 2
# ranks of the mean over 2 micro-batches, the plain one a single mean over all 32 samples
# (the same number, summed in another order).
LOSS_RTOL = 1e-6


def test_exported_file_loads_into_the_plain_model_and_gives_the_distributed_loss(tmp_path):
    job = ["train.steps=6", "train.global_batch=32", "train.micro_batch=8", "checkpoint.every=5", "run.name=r"]
    proc = dtk("dtk.submit", *job, f"run.root={tmp_path}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = RunDir(tmp_path / "r")
    out = tmp_path / "export" / "model.pt"
    proc = dtk("dtk.checkpoint", "export", str(run.path), "--step", "5", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(out.with_name("model.pt.json").read_text())
    assert info["step"] == 5

    model = build(**model_config(info["model"]).kwargs)
    model.load_state_dict(torch.load(out, weights_only=True))  # strict: every name and shape matches

    cfg = Plan.from_json(run.plan_json.read_text()).config
    data = SyntheticTokens(num_samples=cfg.data.num_samples, seq_len=cfg.model.seq_len,
                           vocab_size=cfg.model.vocab_size, seed=cfg.data.seed, branching=cfg.data.branching)
    rows = torch.from_numpy(data.get(GlobalOrder(len(data), cfg.train.seed).global_batch(5, 32)))
    with torch.no_grad():
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()).item()
    logged = run.latest_metrics()[6]["loss"]  # step 6 trains on batch 5 with the weights of step 5
    print(f"plain model {loss!r} vs distributed {logged!r}: relative difference {abs(loss - logged) / logged:.3g}")
    assert abs(loss - logged) <= LOSS_RTOL * logged

    # The same tensors as a safetensors file; a Hugging Face folder is refused for this model.
    require(importlib.util.find_spec("safetensors") is not None, "safetensors is not installed (pip install '.[hf]')")
    from safetensors.torch import load_file

    st = tmp_path / "export" / "model.safetensors"
    proc = dtk("dtk.checkpoint", "export", str(run.path), "--step", "5", "--format", "safetensors", "--out", str(st))
    assert proc.returncode == 0, proc.stderr
    plain = torch.load(out, weights_only=True)
    loaded = load_file(str(st))
    assert loaded.keys() == plain.keys() and all(torch.equal(loaded[k], plain[k]) for k in plain)
    proc = dtk("dtk.checkpoint", "export", str(run.path), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: --format hf: the run's model is")
    assert not (tmp_path / "hf").exists()
