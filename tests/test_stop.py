"""A stop agreed on during evaluation ends the evaluation at the next validation batch."""

from __future__ import annotations

import torch

from dtk.data.synthetic import SyntheticTokens
from dtk.mesh.mesh import ParallelMesh
from dtk.models.transformer import build
from dtk.train.evaluate import Evaluator
from dtk.train.loss import TokenCrossEntropy
from dtk.train.task import LmTask


def evaluator(stop_requested):
    data = SyntheticTokens(num_samples=64, seq_len=16, vocab_size=32, seed=0, branching=2)
    model = build(vocab_size=32, dim=16, num_layers=1, num_heads=2, seq_len=16)
    return Evaluator(model=model, dataset=data, task=LmTask(TokenCrossEntropy()), every=1, total_steps=10, max_samples=0,
                     global_batch=8, micro_batch=4, mesh=ParallelMesh.single(), device=torch.device("cpu"), log=None,
                     stop_requested=stop_requested, autocast_dtype=None)


def test_evaluation_stops_at_the_batch_after_the_signal():
    asked = []

    def stop_after_three() -> bool:
        asked.append(1)
        return len(asked) > 3

    assert evaluator(stop_after_three).after_step(1) is None
    assert len(asked) == 4  # checked before every validation batch, and no further


def test_evaluation_without_a_stop_covers_every_batch():
    asked = []
    values = evaluator(lambda: asked.append(1) or False).evaluate()
    assert values is not None and values["val_loss"] > 0 and len(asked) == 64 // 8
