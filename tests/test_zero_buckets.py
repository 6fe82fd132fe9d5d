"""How ZeRO-1 packs each owner's parameters into broadcast buckets (the equivalence of the
optimizer itself is checked on 2 gloo ranks in tests/test_multirank.py)."""

from __future__ import annotations

import torch
from torch import nn

from dtk.parallel.zero import buckets


def test_buckets_keep_order_and_dtype_and_stay_under_the_limit():
    params = [nn.Parameter(torch.zeros(n, dtype=d)) for n, d in
              [(10, torch.float32), (20, torch.float32), (5, torch.float32), (8, torch.bfloat16), (100, torch.float32),
               (3, torch.float32)]]
    got = buckets(params, limit=30 * 4)
    assert [[p.numel() for p in b] for b in got] == [[10, 20], [5], [8], [100], [3]]
    assert [p for b in got for p in b] == params  # every parameter once, in order
    assert len(buckets(params)) == 3  # the default limit: only the dtype changes cut
