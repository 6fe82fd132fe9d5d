"""scheme.grad_compression on real gloo ranks (dtk.parallel.compression): torch's DDP hooks
registered by `apply_compression`, against DDP's own float32 all-reduce, and PowerSGD's
per-rank state through `state_tensors` / `load_state_tensors` (what the checkpoint keeps)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtk.checkpoint import rng
from dtk.config.choices import GradCompression
from dtk.parallel.compression import POWERSGD_WARMUP, PowerSGD, apply_compression
from multirank import run_on_ranks

pytestmark = pytest.mark.dist


def _ddp(compression: GradCompression) -> tuple[DistributedDataParallel, object]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)))
    return model, apply_compression(model, compression=compression, powersgd_rank=2, group=None)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _grads(model: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    x, y = _batch(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _bf16_against_fp32(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    plain, _ = _ddp(GradCompression.none)
    bf16, state = _ddp(GradCompression.bf16)
    assert state is None
    return _grads(plain, rank, 0), _grads(bf16, rank, 0)


def test_bf16_all_reduces_the_mean_gradient_rounded_to_bfloat16(tmp_path):
    for plain, bf16 in run_on_ranks(_bf16_against_fp32, 2, tmp_path):
        for a, b in zip(plain, bf16, strict=True):
            torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-4)  # bfloat16 keeps 8 bits of mantissa
        assert any(not torch.equal(a, b) for a, b in zip(plain, bf16, strict=True))  # it did compress


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> list[torch.Tensor]:
    after = []
    for step in steps:
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return after


def _powersgd_resume(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Train past the warm-up, keep the state as a checkpoint would, go on; then a fresh DDP
    module and state restored from what was kept go on from the same point, and one whose
    PowerSGD state starts afresh."""
    first = POWERSGD_WARMUP + 3
    model, state = _ddp(GradCompression.powersgd)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _train(model, opt, rank, range(first))
    kept_params = {k: v.clone() for k, v in model.state_dict().items()}
    kept_opt = copy.deepcopy(opt.state_dict())  # its tensors are the live momentum buffers
    assert isinstance(state, PowerSGD)
    rng.keep_rank_state("powersgd0", save=state.state_tensors, restore=lambda t: None)
    kept = {k.partition("/")[2]: v for k, v in rng.rng_state().items() if k.startswith("powersgd0/")}
    assert "error.0" in kept and "q.0" in kept and int(kept["iter"][0]) >= POWERSGD_WARMUP
    torch_rng = torch.get_rng_state()
    went_on = _train(model, opt, rank, range(first, first + 4))

    results = []
    for restore in (True, False):
        again, again_state = _ddp(GradCompression.powersgd)
        again.load_state_dict(kept_params)
        again_opt = torch.optim.SGD(again.parameters(), lr=0.05, momentum=0.9)
        again_opt.load_state_dict(kept_opt)
        assert isinstance(again_state, PowerSGD)
        if restore:  # in a new DDP module, whose first step lays its bucket out otherwise
            again_state.load_state_tensors(kept)
        else:
            again_state.state.iter = POWERSGD_WARMUP  # compressing, without the error feedback and warm start
        torch.set_rng_state(torch_rng)
        results.append(_train(again, again_opt, rank, range(first, first + 4)))
    dist.barrier()
    return went_on, results[0], results[1]


def test_powersgd_state_kept_and_restored_continues_bitwise(tmp_path):
    for went_on, restored, fresh in run_on_ranks(_powersgd_resume, 2, tmp_path):
        assert all(torch.equal(a, b) for a, b in zip(went_on, restored, strict=True))
        assert not torch.equal(went_on[-1], fresh[-1])  # the error feedback is state that matters
