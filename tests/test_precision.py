"""Precision on purpose: the evaluation runs under the training forward's autocast, float32
matmuls are set per device (TF32 on a GPU), float16 is refused (no gradient scaler), and
`auto` gives bfloat16 only on a GPU that computes in it. All on the CPU: the choices are
functions of the device, tested with the device's answers given."""

from __future__ import annotations

import pytest
import torch

from dtk.common.errors import UserError
from dtk.config.choices import Dtype, MatmulPrecision
from dtk.config.compose import compose
from dtk.data.synthetic import SyntheticTokens
from dtk.mesh.mesh import ParallelMesh
from dtk.models.transformer import build
from dtk.parallel.precision import autocast, matmul_precision, resolve_dtype
from dtk.plan.plan import make_plan
from dtk.train.evaluate import Evaluator
from dtk.train.loss import TokenCrossEntropy
from dtk.train.task import LmTask

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def evaluate(model, data, dtype):
    return Evaluator(model=model, dataset=data, task=LmTask(TokenCrossEntropy()), every=1, total_steps=1, max_samples=0,
                     global_batch=8, micro_batch=4, mesh=ParallelMesh.single(), device=CPU, log=None,
                     stop_requested=None, autocast_dtype=dtype).evaluate()["val_loss"]


def test_the_evaluation_runs_under_the_training_autocast():
    torch.manual_seed(0)
    model = build(vocab_size=64, dim=32, num_layers=2, num_heads=4, seq_len=16)
    data = SyntheticTokens(num_samples=16, seq_len=16, vocab_size=64, seed=0, branching=2)
    rows = torch.from_numpy(data.get(list(range(16))))
    loss = TokenCrossEntropy()
    with torch.no_grad():
        with autocast(CPU, torch.bfloat16):  # as the trainer runs the forward
            logits = model(rows[:, :-1])
        summed, count = loss.total(logits, rows[:, 1:])
    under_autocast = evaluate(model, data, torch.bfloat16)
    assert under_autocast == pytest.approx(summed.item() / count, rel=1e-6)
    assert under_autocast != evaluate(model, data, None)  # the fp32 forward gives another number


def test_float16_is_refused_at_plan_time():
    for key in ("param_dtype", "reduce_dtype"):
        with pytest.raises(UserError, match=f"scheme.{key}=float16: dtk has no gradient scaler"):
            make_plan(compose(["+scheme=fsdp", f"scheme.{key}=float16"]))


def test_auto_is_bfloat16_only_on_a_gpu_that_computes_in_it():
    auto = dict(auto=torch.bfloat16, key="scheme.param_dtype")
    assert resolve_dtype(Dtype.auto, CUDA, bf16=True, **auto) == torch.bfloat16
    assert resolve_dtype(Dtype.auto, CUDA, bf16=False, **auto) == torch.float32  # a V100, a T4
    assert resolve_dtype(Dtype.auto, CPU, **auto) == torch.float32
    assert resolve_dtype(Dtype.float32, CUDA, bf16=False, **auto) == torch.float32
    assert resolve_dtype(Dtype.auto, CUDA, bf16=False, auto=torch.float32, key="scheme.reduce_dtype") == torch.float32


def test_explicit_bfloat16_on_a_gpu_without_it_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    with pytest.raises(UserError, match=r"scheme.param_dtype=bfloat16: this GPU \(Tesla V100-SXM2-32GB\) has no"):
        resolve_dtype(Dtype.bfloat16, CUDA, auto=torch.bfloat16, key="scheme.param_dtype", bf16=False)


def test_float32_matmuls_use_tf32_on_a_gpu_unless_asked_otherwise():
    assert matmul_precision(MatmulPrecision.auto, CUDA) == "high"
    assert matmul_precision(MatmulPrecision.auto, CPU) == "highest"
    assert matmul_precision(MatmulPrecision.highest, CUDA) == "highest"
    assert matmul_precision(MatmulPrecision.medium, CPU) == "medium"
