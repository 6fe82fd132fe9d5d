"""A dataset of the user's own (dtk.data.user): batches keep the items' structure, the split
is fixed by its seed, the version changes when the data does, and the order of samples per
global step does not depend on the number of data-parallel ranks. Fast: no processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtk.common.errors import UserError
from dtk.data.order import GlobalOrder, rank_share
from dtk.data.user import build_user_splits, collate, fingerprint


class Items:
    """Item i is (a 2x2 image whose pixels are i, label i % 3): every id visible in a batch."""

    def __init__(self, n: int, offset: float = 0.0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full((2, 2), i + self.offset, dtype=np.float32), i % 3


def items(n: int = 100, offset: float = 0.0) -> Items:
    return Items(n, offset)


def dict_items(n: int = 10):
    return {"train": [{"x": torch.full((3,), float(i)), "y": i} for i in range(n)], "validation": [{"x": torch.zeros(3), "y": 0}]}


def test_collate_keeps_the_structure():
    batch = collate([items()[i] for i in (4, 7)])
    assert isinstance(batch, tuple) and batch[0].shape == (2, 2, 2) and batch[1].tolist() == [1, 1]
    batch = collate([{"x": torch.ones(3), "y": 2, "name": "a"}, {"x": torch.zeros(3), "y": 5, "name": "b"}])
    assert batch["x"].shape == (2, 3) and batch["y"].tolist() == [2, 5] and batch["name"] == ["a", "b"]
    with pytest.raises(UserError, match="a sample of type object"):
        collate([object()])


def test_split_is_fixed_by_its_seed_and_recorded():
    train, val, split = build_user_splits(target="test_user_data.items", kwargs={"n": 100}, val_fraction=0.2,
                                          split_seed=7, version=None)
    again, val_again, split_again = build_user_splits(target="test_user_data.items", kwargs={"n": 100},
                                                      val_fraction=0.2, split_seed=7, version=None)
    assert (len(train), len(val)) == (80, 20) and split == split_again
    seen = {int(x) for x in train.get(np.arange(80))[0][:, 0, 0]} | {int(x) for x in val.get(np.arange(20))[0][:, 0, 0]}
    assert seen == set(range(100))  # every item in exactly one split
    other = build_user_splits(target="test_user_data.items", kwargs={"n": 100}, val_fraction=0.2, split_seed=8,
                              version=None)[2]
    assert other.validation_ids != split.validation_ids
    # A function may return both sets itself; a given version wins over the fingerprint.
    train, val, split = build_user_splits(target="test_user_data.dict_items", kwargs={}, val_fraction=0.5,
                                          split_seed=0, version="v3")
    assert (len(train), len(val), split.source, train.version) == (10, 1, "function", "v3")


def test_version_follows_the_content():
    assert fingerprint(items()) == fingerprint(items())
    assert fingerprint(items()) != fingerprint(items(offset=0.5))  # same length, other values
    assert fingerprint(items()) != fingerprint(items(n=101))
    version = build_user_splits(target="test_user_data.items", kwargs={"n": 100}, val_fraction=0.2, split_seed=0,
                                version=None)[0].version
    assert version.startswith("sha-")


@pytest.mark.parametrize("dp_size", [2, 4])
def test_order_per_global_step_is_the_same_on_1_2_and_4_ranks(dp_size):
    train = build_user_splits(target="test_user_data.items", kwargs={"n": 100}, val_fraction=0.2, split_seed=0,
                              version=None)[0]
    order = GlobalOrder(len(train), seed=5)
    for step in (0, 1, 4, 9):  # 9 crosses an epoch: 16 x 10 > 80 samples
        ids = order.global_batch(step, 16)
        alone = train.get(ids)[0][:, 0, 0]
        shared = torch.cat([train.get(rank_share(ids, r, dp_size))[0][:, 0, 0] for r in range(dp_size)])
        assert torch.equal(alone, shared)


def test_not_a_dataset_is_a_user_error():
    with pytest.raises(UserError, match="expected a map-style dataset"):
        build_user_splits(target="builtins.object", kwargs={}, val_fraction=0.1, split_seed=0, version=None)
    with pytest.raises(UserError, match="cannot import it"):
        build_user_splits(target="no_such_module.fn", kwargs={}, val_fraction=0.1, split_seed=0, version=None)


def test_the_loader_gives_each_rank_its_share_of_the_same_global_batches_on_1_2_and_4_ranks():
    """dtk's loader (read-ahead, micro-batches) over a configured user dataset: the ranks'
    micro-batches of a step, put together, are the one-rank batch, sample for sample."""
    from dtk.config.compose import compose
    from dtk.data.loader import StepBatches, build_splits

    cfg = compose(["data=user", "data._target_=test_user_data.items", "+data.kwargs.n=100", "data.val_fraction=0.2"])
    train, _ = build_splits(cfg.data, model=cfg.model)

    def pixels(dp_size: int, rank: int, step: int) -> list[int]:
        batches = StepBatches(train, seed=5, global_batch=16, micro_batch=2, dp_rank=rank, dp_size=dp_size,
                              device=torch.device("cpu"))
        try:
            return [int(v) for images, _labels in batches.get(step) for v in images[:, 0, 0]]
        finally:
            batches.close()

    for step in (0, 3, 9):  # 9 crosses an epoch: 16 x 10 > 80 samples
        alone = pixels(1, 0, step)
        assert len(alone) == 16
        for dp_size in (2, 4):
            assert [v for r in range(dp_size) for v in pixels(dp_size, r, step)] == alone
