"""dtk.train.sync on real gloo ranks, each piece against its one-process equivalent:

- local SGD with H=1 and plain SGD is every-step data parallelism: its parameters equal those
  of one process stepping on the whole global batch, with plain replicas (2 ranks) and with
  FSDP inside each replica (2 replicas x 2 shards);
- DiLoCo with outer lr 1 and no momentum is local SGD (the outer step adds the mean delta);
- between two synchronizations the replicas do not talk (their parameters differ), after
  one they are bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtk.config.choices import SyncDtype, SyncMode
from dtk.config.schema import SyncConfig
from dtk.train.sync import Synchronizer
from multirank import run_on_ranks

pytestmark = pytest.mark.dist

STEPS, BATCH, LR = 6, 8, 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's global batch; rank r reads rows [r x BATCH/world, (r+1) x BATCH/world)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(STEPS)]


def _share(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = BATCH // world
    return batch[rank * n:(rank + 1) * n]


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


def _one_process() -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in _batches(1):
        _step(model, opt, x, y)
    return [p.detach().clone() for p in model.parameters()]


def _local_sgd_every_step(rank: int, world: int, shards: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """H=1 local SGD with SGD over world/shards replicas, FSDP over `shards` ranks inside each."""
    model = _model()
    group = dist.group.WORLD
    if shards > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("dp_replicate", "dp_shard"))
        fully_shard(model, mesh=mesh["dp_shard"])
        group = mesh["dp_replicate"].get_group()
    sync = Synchronizer(sync=SyncConfig(mode=SyncMode.local_sgd, every=1), model=model, group=group,
                        replicas=world // shards)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for index, (x, y) in enumerate(_batches(world)):
        _step(model, opt, _share(x, rank, world), _share(y, rank, world))
        sync.after_step(index + 1)
    assert sync.syncs == STEPS
    return [_full(p) for p in model.parameters()], _one_process()


@pytest.mark.parametrize("world, shards", [(2, 1), (4, 2)], ids=["replicas", "fsdp_inside_replicas"])
def test_local_sgd_every_step_with_sgd_is_one_process_on_the_global_batch(tmp_path, world, shards):
    for got, want in run_on_ranks(_local_sgd_every_step, world, tmp_path, shards):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _inner_steps(rank: int, world: int, sync_cfg: SyncConfig) -> tuple[list[list[torch.Tensor]], int]:
    """AdamW inner steps under `sync_cfg`; every replica's parameters after each step."""
    model = _model()
    sync = Synchronizer(sync=sync_cfg, model=model, group=dist.group.WORLD, replicas=world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    after = []
    for index, (x, y) in enumerate(_batches(world)):
        _step(model, opt, _share(x, rank, world), _share(y, rank, world))
        sync.after_step(index + 1)
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return after, sync.syncs


def _diloco_plain_and_local_sgd(rank: int, world: int) -> tuple:
    local = _inner_steps(rank, world, SyncConfig(mode=SyncMode.local_sgd, every=3))
    diloco = _inner_steps(rank, world, SyncConfig(mode=SyncMode.diloco, every=3, outer_lr=1.0, outer_momentum=0.0,
                                                  outer_nesterov=False))
    nesterov = _inner_steps(rank, world, SyncConfig(mode=SyncMode.diloco, every=3))
    bf16 = _inner_steps(rank, world, SyncConfig(mode=SyncMode.diloco, every=3, dtype=SyncDtype.bfloat16))
    return local, diloco, nesterov, bf16


def test_diloco_with_outer_lr_1_and_no_momentum_is_local_sgd_and_replicas_differ_only_between_syncs(tmp_path):
    ranks = run_on_ranks(_diloco_plain_and_local_sgd, 2, tmp_path)
    (local0, syncs), (diloco0, _), (nesterov0, _), (bf16_0, _) = ranks[0]
    (local1, _), (diloco1, _), (nesterov1, _), (bf16_1, _) = ranks[1]
    assert syncs == STEPS // 3
    for a, b in zip(local0, diloco0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for step, (p0, p1) in enumerate(zip(local0, local1, strict=True), start=1):
        if step % 3:  # inner steps on each replica's own data: no exchange
            assert not torch.equal(p0, p1), step
        else:  # synchronized: every rank computed the same bytes
            assert torch.equal(p0, p1), step
    assert torch.equal(nesterov0[-1], nesterov1[-1]) and torch.equal(diloco0[-1], diloco1[-1])
    # the outer momentum moves the anchor further than the plain mean after the second sync
    assert not torch.allclose(nesterov0[-1], local0[-1], atol=1e-4)
    # deltas sent in bfloat16: the same replicas' model, the deltas rounded to 8 bits of mantissa
    assert torch.equal(bf16_0[-1], bf16_1[-1]) and not torch.equal(bf16_0[-1], nesterov0[-1])
    torch.testing.assert_close(bf16_0[-1], nesterov0[-1], rtol=0, atol=1e-3)



def _reference_diloco(rank: int, world: int, every: int, fragments: list[list[int]]) -> list[torch.Tensor]:
    """DiLoCo written out plainly: after step s, each fragment f with s % every == f x every/F
    all-reduces its own deltas and one Nesterov SGD per fragment steps its anchors."""
    model = _model()
    params = list(model.parameters())
    anchors = [p.detach().clone().requires_grad_(True) for p in params]
    outers = [torch.optim.SGD([anchors[i] for i in frag], lr=0.7, momentum=0.9, nesterov=True) for frag in fragments]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stride = every // len(fragments)
    after = []
    for index, (x, y) in enumerate(_batches(world)):
        _step(model, opt, _share(x, rank, world), _share(y, rank, world))
        step = index + 1
        for f, frag in enumerate(fragments):
            if step % every != f * stride:
                continue
            with torch.no_grad():
                flat = torch.cat([(anchors[i] - params[i]).reshape(-1) for i in frag])
                dist.all_reduce(flat)
                flat.div_(world)
                offset = 0
                for i in frag:
                    n = anchors[i].numel()
                    anchors[i].grad = flat[offset:offset + n].view_as(anchors[i]).clone()
                    offset += n
                outers[f].step()
                outers[f].zero_grad(set_to_none=True)
                for i in frag:
                    params[i].copy_(anchors[i])
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return after


def _fragments(rank: int, world: int) -> tuple:
    from dtk.train.sync import fragments_of

    whole = _inner_steps(rank, world, SyncConfig(mode=SyncMode.diloco, every=3))
    one = _reference_diloco(rank, world, 3, [[0, 1, 2, 3]])
    cut = fragments_of([p.numel() for p in _model().parameters()], 2)
    two = _inner_steps(rank, world, SyncConfig(mode=SyncMode.diloco, every=2, fragments=2))
    two_reference = _reference_diloco(rank, world, 2, cut)
    return whole, one, cut, two, two_reference


def test_fragments_are_synchronized_in_turn_and_one_fragment_is_the_whole_model(tmp_path):
    ranks = run_on_ranks(_fragments, 2, tmp_path)
    (whole0, _), one0, cut, (two0, syncs), two_reference0 = ranks[0]
    (_, _), _, _, (two1, _), _ = ranks[1]
    # sync.fragments=1 (the default) is the whole model at once, bit for bit the plain algorithm
    assert all(torch.equal(a, b) for a, b in zip(whole0, one0, strict=True))
    # two fragments of the 6x16, 16, 16x3, 3 model: whole tensors, in order; the first closes at
    # the tensor where the running total reaches half the elements (96 of 163)
    assert cut == [[0], [1, 2, 3]]
    assert syncs == STEPS  # every step one fragment: 0 after even steps, 1 after odd ones
    assert all(torch.equal(a, b) for a, b in zip(two0, two_reference0, strict=True))
    first = 96
    for step, (p0, p1) in enumerate(zip(two0, two1, strict=True), start=1):
        synced, own = (p0[:first], p1[:first]), (p0[first:], p1[first:])
        if step % 2:  # fragment 1 synchronized, fragment 0 has one inner step of its own
            synced, own = own, synced
        assert torch.equal(*synced), step
        assert not torch.equal(*own), step


def test_the_fragment_cut_takes_whole_tensors_and_refuses_more_fragments_than_tensors():
    from dtk.common.errors import UserError
    from dtk.train.sync import fragments_of

    assert fragments_of([10, 10, 10, 10], 1) == [[0, 1, 2, 3]]
    assert fragments_of([10, 10, 10, 10], 4) == [[0], [1], [2], [3]]
    assert fragments_of([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert fragments_of([1, 1, 1, 100], 3) == [[0, 1], [2], [3]]  # each later fragment keeps one tensor
    with pytest.raises(UserError, match=r"sync.fragments=5: the model has 4 trainable tensors"):
        fragments_of([10, 10, 10, 10], 5)
