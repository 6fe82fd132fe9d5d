"""Compile per block with fullgraph: the built-in transformer's block is one graph (its
output unchanged), and a block with a graph break fails at its first forward instead of
running in pieces. Dynamo's tracing is what decides; the `eager` backend skips code
generation, so this runs in seconds on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtk.models.transformer import build
from dtk.parallel.compile import apply_compile


@pytest.mark.slow
def test_the_builtin_blocks_compile_to_one_graph_each():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build(vocab_size=32, dim=16, num_layers=2, num_heads=2, seq_len=8)
    tokens = torch.randint(0, 32, (2, 8))
    want = model(tokens)
    apply_compile(model, wrap_classes=("Block",), fullgraph=True, backend="eager")
    torch.testing.assert_close(model(tokens), want)


class Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        torch._dynamo.graph_break()  # what an unsupported call in a user's block does
        return -y


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Breaks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_a_graph_break_is_an_error_with_fullgraph_and_allowed_without():
    torch._dynamo.reset()
    strict = Model()
    apply_compile(strict, wrap_classes=("Breaks",), fullgraph=True, backend="eager")
    with pytest.raises(torch._dynamo.exc.Unsupported):
        strict(torch.randn(2, 4))
    torch._dynamo.reset()
    lenient = Model()
    apply_compile(lenient, wrap_classes=("Breaks",), fullgraph=False, backend="eager")
    assert lenient(torch.randn(2, 4)).shape == (2, 4)
