"""hvd_ext.pipeline: bucket planning, and the dense warm-up before the codec (simulated ranks)."""
from __future__ import annotations

import torch

from hvd_ext.pipeline import plan_buckets
from hvd_ext.testing.harness import run_pipeline

from helpers.simgrads import make_grads, mean_of


def test_plan_buckets_is_deterministic_and_bounded():
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([10, 300, 50, 700, 5])]
    b = plan_buckets(params, bucket_bytes=1200)
    assert b == plan_buckets(params, bucket_bytes=1200)
    assert sorted(i for bucket in b for i in bucket) == list(range(5))
    assert b[0][0] == 4  # reverse order: last parameter first (backward order)
    for bucket in b:
        if len(bucket) > 1:
            assert sum(params[i][1].numel() * 4 for i in bucket) <= 1200


def test_first_bucket_takes_the_tensor_that_crosses_its_size():
    """The first bucket (backward order) closes once it holds first_bucket_bytes, so a large last
    layer goes in it and its exchange overlaps the rest of backward; no bucket exceeds bucket_bytes
    unless it holds a single tensor."""
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([400, 300, 200, 250, 10])]
    b = plan_buckets(params, bucket_bytes=4000, first_bucket_bytes=800)
    assert b[0] == [4, 3]  # 40 B, then 1000 B crosses 800 B: both in the first bucket
    assert b[1:] == [[2, 1, 0]]
    assert plan_buckets(params, bucket_bytes=900, first_bucket_bytes=800)[0] == [4]  # never past bucket_bytes


def test_pipeline_dense_warmup_then_codec():
    """The first ``warmup`` exchanges are the exact mean with no memory kept; then the codec runs
    (with its error feedback starting from zero), on every simulated rank alike."""
    size, steps, warm = 3, 5, 2
    grads = make_grads(size, steps, seed=3)
    runs = run_pipeline("topk:ratio=0.05", grads, size, warmup=warm)
    for r in runs:
        for step in range(steps):
            exact = mean_of(grads, step, size)
            got = r.results[step]
            same = all(torch.allclose(got[k], exact[k], atol=1e-6) for k in exact)
            assert same == (step < warm), (r.rank, step)
        assert r.pipeline.routes == runs[0].pipeline.routes
    plain = run_pipeline("topk:ratio=0.05", grads[warm:], size)
    for step in range(steps - warm):  # after the warm-up: exactly a fresh topk run
        for k in grads[0][0]:
            assert torch.allclose(runs[0].results[warm + step][k], plain[0].results[step][k], atol=1e-6)
