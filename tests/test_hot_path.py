"""The training loop's hot path, in the parts that choose what runs on a GPU: each choice
is a function of the device, checked here on the CPU for the CUDA case, and the CPU path
it leaves is the one that runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dtk.data.batch import Transfer, to_device, transfer_for
from dtk.data.loader import StepBatches
from dtk.train.loss import TokenCrossEntropy
from dtk.train.optim import adamw_kernel
from dtk.worker.allocator import allocator_env


def test_batches_reach_a_cuda_device_pinned_non_blocking_on_a_side_stream():
    assert transfer_for("cuda") == Transfer(pinned=True, non_blocking=True, side_stream=True)
    assert transfer_for("cpu") == Transfer(pinned=False, non_blocking=False, side_stream=False)


class _Tokens:
    version = "v"

    def __len__(self) -> int:
        return 64

    def get(self, ids: np.ndarray) -> np.ndarray:
        return np.stack([np.arange(9) + i for i in ids])


def test_the_cpu_loader_takes_the_plain_path_and_keeps_the_batches():
    batches = StepBatches(_Tokens(), seed=0, global_batch=8, micro_batch=2, dp_rank=0, dp_size=1,
                          device=torch.device("cpu"))
    try:
        assert batches.transfer == transfer_for("cpu") and batches._stream is None
        micro = batches.get(0)
        assert len(micro) == 4 and all(m.shape == (2, 9) for m in micro)
        nested = to_device({"x": torch.ones(2), "names": ["a", "b"]}, torch.device("cpu"))
        assert torch.equal(nested["x"], torch.ones(2)) and nested["names"] == ["a", "b"]
    finally:
        batches.close()


def test_the_chunked_loss_equals_the_whole_cast():
    """bf16 logits over a vocabulary of 96, 5 rows per chunk (uneven last chunk): the same
    mean and sum as casting all of them at once, and the same gradient."""
    torch.manual_seed(0)
    logits = torch.randn(3, 11, 96).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 96, (3, 11))
    chunked = TokenCrossEntropy(chunk_elements=5 * 96)
    assert chunked._rows(logits) == 5
    loss = chunked(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    whole = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    (want,) = torch.autograd.grad(whole, logits)
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(grad.float(), want.float(), atol=1e-6)
    summed, count = chunked.total(logits, targets)
    assert count == 33 and summed.item() == pytest.approx(whole.item() * 33, rel=1e-6)
    assert TokenCrossEntropy(chunk_elements=5 * 96)._rows(logits.float()) is None  # float32: nothing to cast


def test_adamw_is_fused_on_cuda_and_foreach_elsewhere():
    assert adamw_kernel({"cuda"}) == {"fused": True}
    assert adamw_kernel({"cpu"}) == {"foreach": True}
    assert adamw_kernel({"cpu", "cuda"}) == {"foreach": True}  # offload leaves a mix: fused cannot take it


def test_the_allocator_gets_expandable_segments_unless_the_user_set_it():
    assert allocator_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    assert allocator_env({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}
