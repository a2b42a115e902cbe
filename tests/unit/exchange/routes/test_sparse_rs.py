"""The sparse reduce-scatter route: the pair codec, and the result against a global top-k reference."""
import math

import pytest
import torch

from hvd_ext.exchange.routes.sparse_rs import decode_pairs, encode_pairs
from hvd_ext.testing.harness import run_pipeline

from helpers.simgrads import SHAPES, make_grads


@pytest.mark.parametrize("span", [10, 70000])
def test_pair_codec_round_trip(span):
    idx = torch.tensor([0, 3, span - 1])
    vals = torch.tensor([1.5, -2.0, 3.25])
    got_i, got_v = decode_pairs(encode_pairs(idx, vals, span, torch.float32), span, torch.float32)
    assert got_i.tolist() == idx.tolist() and torch.equal(got_v, vals)
    assert encode_pairs(idx, vals, span, torch.float32).numel() == 3 * (4 + (2 if span <= 65536 else 4))


@pytest.mark.parametrize("size", [2, 3, 4])
def test_sparse_reduce_scatter_equals_global_topk_reference(size):
    """One step, no prior memory: the result equals, per owner range, the ceil(received/N)
    largest entries of the sum of every rank's top-k selection (gTop-k)."""
    grads = make_grads(size, 1, seed=10 + size)
    spec = "topk:ratio=0.05,scope=layer,route=twophase,feedback=none"  # k per tensor, as below
    runs = run_pipeline(spec, grads, size)
    names = list(SHAPES)
    # reference, from all ranks' inputs: buckets are filled in reverse parameter order
    order = list(reversed(names))
    flat = [torch.cat([grads[0][r][k].reshape(-1) for k in order]) for r in range(size)]
    total = flat[0].numel()
    sel_sum = torch.zeros(total)
    received = torch.zeros(size, dtype=torch.long)
    bounds = [0]
    for s in [total // size + (1 if j < total % size else 0) for j in range(size)]:
        bounds.append(bounds[-1] + s)
    start = 0
    for k in order:
        n = grads[0][0][k].numel()
        kk = math.ceil(0.05 * n)
        for r in range(size):
            idx = torch.topk(grads[0][r][k].reshape(-1).abs(), kk).indices + start
            sel_sum[idx] += flat[r][idx]
            for j in range(size):
                received[j] += int(((idx >= bounds[j]) & (idx < bounds[j + 1])).sum())
        start += n
    ref = torch.zeros(total)
    for j in range(size):
        lo, hi = bounds[j], bounds[j + 1]
        budget = math.ceil(int(received[j]) / size)
        part = sel_sum[lo:hi]
        top = torch.topk(part.abs(), budget).indices
        ref[lo + top] = part[top] / size
    got = torch.cat([runs[0].results[0][k].reshape(-1) for k in order])
    assert runs[0].routes == ["sparse_rs"]
    assert torch.allclose(got, ref, atol=1e-6)
    for run in runs[1:]:
        assert torch.equal(torch.cat([run.results[0][k].reshape(-1) for k in order]), got)
