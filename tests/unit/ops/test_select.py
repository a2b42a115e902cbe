"""hvd_ext.ops.select: the candidate top-k and the mask scan against their references."""
from __future__ import annotations

import torch

from hvd_ext.ops import select


def test_candidate_topk_is_exact_with_ties():
    g = torch.Generator().manual_seed(0)
    n = 300_000
    for score in (torch.randn(n, generator=g).abs(),
                  torch.randint(0, 50, (n,), generator=g).float(),   # many ties at the threshold
                  torch.zeros(n)):
        for k in (1, 100, 3000, n // 9):
            fast = select.topk_indices(score, k)
            ref = select.topk_small(score, k)
            assert torch.equal(fast, ref), k
    nan = torch.rand(n, generator=g)
    nan[7] = float("nan")
    assert torch.equal(select.topk_indices(nan, 50), select.topk_small(nan, 50))


def test_indices_where_matches_nonzero():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(100_003, generator=g)
    for thr in (0.0, 0.5, 0.999, 1.0):
        assert torch.equal(select.indices_where(x, thr), (x >= thr).nonzero().squeeze(1))
        assert torch.equal(select.indices_where(x, thr, strict=True), (x > thr).nonzero().squeeze(1))
