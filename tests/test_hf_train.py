"""A tiny Hugging Face Llama (random weights, a config.json written here) trained by config
alone, `model=hf model.config=DIR`, with `python -m dtk.submit` on 2 processes under ddp,
fsdp and tp; exported with `--format hf`, loaded by transformers' `from_pretrained`, and
continued from with `model.init_from`.

Tolerances (fp32 on the CPU): fsdp and tp losses within 1e-4 of ddp per step (they differ
in the order of sums: gradient reduce-scatter, row-parallel matmuls; measured 0 and 4.8e-7);
from_pretrained's logits within 1e-5 of dtk's model with the same weights (the same class
and kernels: measured 0); the first loss of an init_from run within 1e-5 (relative) of the
exported model's loss on that batch.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import dtk, losses, require

pytestmark = [pytest.mark.slow, pytest.mark.dist]

LOSS_TOL = 1e-4
LOGITS_TOL = 1e-5
INIT_RTOL = 1e-5
SEQ_LEN, VOCAB, BATCH = 16, 128, 8
JOB = [f"model.seq_len={SEQ_LEN}", f"model.vocab_size={VOCAB}", "data.num_samples=256", "train.steps=4",
       f"train.global_batch={BATCH}", "optim.warmup_steps=1", "checkpoint.every=4", "train.log_every=1000"]


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory) -> dict[str, Path]:
    require(
        importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("safetensors") is not None,
        "transformers and safetensors are not installed (pip install '.[hf]')",
    )
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("hf")
    AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    ).save_pretrained(root / "tiny-llama")
    runs = {"root": root}
    for name, extra in {"ddp": [], "fsdp": ["+scheme=fsdp"], "tp": ["+scheme=tp"]}.items():
        proc = dtk("dtk.submit", "model=hf", f"model.config={root / 'tiny-llama'}", *JOB, *extra, "tasks_per_node=2",
                   f"run.root={root}", f"run.name={name}", cwd=root, timeout=600)
        assert proc.returncode == 0, f"{name}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        runs[name] = root / name
    return runs


def test_fsdp_and_tp_match_ddp(hf_runs):
    ddp = losses(hf_runs["ddp"])
    assert sorted(ddp) == [1, 2, 3, 4]
    for scheme in ("fsdp", "tp"):
        got = losses(hf_runs[scheme])
        worst = max(abs(got[s] - ddp[s]) for s in ddp)
        print(f"{scheme} vs ddp: worst loss difference {worst:.3g}")
        assert sorted(got) == sorted(ddp) and worst <= LOSS_TOL


def test_export_loads_in_transformers_and_init_from_continues_from_it(hf_runs):
    from transformers import AutoModelForCausalLM

    from dtk.config.convert import model_config
    from dtk.data.order import GlobalOrder
    from dtk.data.synthetic import SyntheticTokens
    from dtk.models.build import build_model
    from dtk.plan.plan import Plan

    root, run = hf_runs["root"], hf_runs["ddp"]
    proc = dtk("dtk.checkpoint", "export", str(run), "--format", "hf", "--out", str(root / "exported"))
    assert proc.returncode == 0, proc.stderr
    proc = dtk("dtk.checkpoint", "export", str(run), "--out", str(root / "state.pt"))
    assert proc.returncode == 0, proc.stderr

    # dtk's own model (the factory of model=hf) holding the checkpoint's weights.
    cfg = Plan.from_json((run / "plan.json").read_text()).config
    ours = build_model(model_config(json.loads((root / "state.pt.json").read_text())["model"]), device="cpu", seed=0)
    ours.load_state_dict(torch.load(root / "state.pt", weights_only=True))
    theirs = AutoModelForCausalLM.from_pretrained(str(root / "exported"), dtype=torch.float32)
    ours.eval(), theirs.eval()
    data = SyntheticTokens(num_samples=cfg.data.num_samples, seq_len=SEQ_LEN, vocab_size=VOCAB, seed=cfg.data.seed,
                           branching=cfg.data.branching)
    rows = torch.from_numpy(data.get(GlobalOrder(len(data), cfg.train.seed).global_batch(0, BATCH)))
    with torch.no_grad():
        want = theirs(rows[:, :-1]).logits
        got = ours(rows[:, :-1])
    diff = (got - want).abs().max().item()
    print(f"from_pretrained vs dtk's model: max logit difference {diff:.3g}")
    assert diff <= LOGITS_TOL
    exported_loss = F.cross_entropy(want.flatten(0, 1), rows[:, 1:].flatten()).item()

    # A run that starts from the exported folder: its first step trains on global batch 0.
    proc = dtk("dtk.submit", "model=hf", f"model.init_from={root / 'exported'}", *JOB, "train.steps=1",
               "tasks_per_node=1", f"run.root={root}", "run.name=init_from", cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    first = losses(root / "init_from")[1]
    print(f"init_from first loss {first!r} vs exported model {exported_loss!r}")
    assert abs(first - exported_loss) <= INIT_RTOL * exported_loss
