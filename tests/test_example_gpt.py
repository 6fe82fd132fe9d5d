"""examples/gpt end to end, as its README says: a GPT-2-style model of the project's own
(tied head, a constructor that prints, forward(idx, targets) -> (logits, loss)) on the
standard library's sources prepared with --tokenizer chars --val-fraction 0.1, trained by
dtk.submit under ddp and fsdp on 2 processes and by the plain PyTorch loop of plain.py.

The plain loop starts from the same values on the same batches with the same optimizer and
schedule, so each step's loss agrees within float noise (measured ~1e-7 relative); the
exported weights of the fsdp run hold the tie."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, dtk, losses

pytestmark = [pytest.mark.slow, pytest.mark.dist]

EXAMPLE = REPO / "examples" / "gpt"
STEPS = 10
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpt") / "gpt"
    shutil.copytree(EXAMPLE, folder, ignore=lambda d, names: [n for n in names if n == "__pycache__" or (
        Path(d) == EXAMPLE and n in ("data", "runs"))])
    for cmd in (["gpt.py", "corpus"],
                ["-m", "dtk.data", "prepare", "--input", "data/stdlib.txt", "--out", "data/stdlib", "--tokenizer",
                 "chars", "--val-fraction", "0.1"]):
        proc = subprocess.run([sys.executable, *cmd], cwd=folder, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    return folder


@pytest.fixture(scope="module")
def runs(project) -> dict[str, Path]:
    out = {}
    for name, extra in {"ddp": [], "fsdp": ["+scheme=fsdp"]}.items():
        proc = dtk("dtk.submit", f"train.steps={STEPS}", "train.eval_every=5", f"run.name={name}", *extra, cwd=project,
                   timeout=600)
        assert proc.returncode == 0, f"{name}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        assert "model output: number of parameters: 0.82M" in proc.stderr  # the constructor printed, and planning went on
        out[name] = project / "runs" / name
    return out


def test_dtk_under_ddp_and_fsdp_matches_the_plain_pytorch_loop_per_step(project, runs):
    proc = subprocess.run([sys.executable, "plain.py", "--steps", str(STEPS), "--eval-every", "5", "--out", "plain.jsonl"],
                          cwd=project, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    plain = [json.loads(line) for line in (project / "plain.jsonl").read_text().splitlines()]
    want = {r["step"]: r["loss"] for r in plain}
    for name, run in runs.items():
        got = losses(run)
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
        worst = max(abs(got[s] - want[s]) / want[s] for s in want)
        print(f"{name} vs plain: largest relative loss difference {worst:.3g}")
        assert worst <= REL_TOL, name
        evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
        plain_val = [r["val_loss"] for r in plain if "val_loss" in r]
        assert [e["step"] for e in evals] == [5, 10] and evals[-1]["val_samples"] == 512
        assert abs(evals[-1]["val_loss"] - plain_val[-1]) <= REL_TOL * plain_val[-1]
    assert want[STEPS] < want[1] - 0.5  # it learns


def test_the_exported_fsdp_weights_keep_the_tie_and_load_into_the_plain_model(project, runs, tmp_path):
    import torch

    out = tmp_path / "model.pt"
    proc = dtk("dtk.checkpoint", "export", str(runs["fsdp"]), "--out", str(out), cwd=project)
    assert proc.returncode == 0, proc.stderr
    state = torch.load(out, map_location="cpu")
    assert torch.equal(state["head.weight"], state["wte.weight"])
    sys.path.insert(0, str(project))
    try:
        from gpt import build
    finally:
        sys.path.remove(str(project))
    model = build(vocab_size=128, seq_len=64)
    model.load_state_dict(state)
    assert model.head.weight is model.wte.weight
