"""The host-sync budget of the data path (docs/gpu.md), counted on an emulated GPU.

Every registered codec (and the variants whose sizes depend on the data), every route -- allreduce,
allgather, two-phase / sparse reduce-scatter, node-aware -- at N = 2, 3, 4 and 8 simulated ranks
runs the real pipeline on tensors that say they are CUDA tensors (``hvd_ext.testing.device``);
every read of a device value the code makes (``.item()``, ``.tolist()``, ``bool()``, ``nonzero``,
a blocking upload, ...) is counted per rank per step:

* at most 2 per bucket per step plus 2 per step, whatever N and the number of tensors;
* at most 1 per step for none, fp16 and bf16;
* none inside a backward hook.

The kernels run their torch references here (the emulated GPU has no CuPy); the kernels' own host
code is held to the same rule by tests/unit/ops/test_cuda_kernels.py on the CPU harness.
"""
from __future__ import annotations

import pytest
import torch

from hvd_ext.ops import cuda_kernels as K
from hvd_ext.spec import list_compressors
from hvd_ext.exchange import cost
from hvd_ext.testing.harness import run_pipeline
from hvd_ext.testing.syncs import count_syncs, make_grads

# 6 tensors of 64 to 12k elements in 64 KiB buckets: two buckets
SHAPES = [(64,), (96, 128), (500,), (3000,), (12000,), (300,)]
BUCKET = 64 * 1024
SLOW_INTER = cost.NodeModel(inter=cost.LinkModel(alpha=1e-3, bandwidth=1e6))  # node-aware pays: it is chosen
# the registered codecs with their defaults, and the variants whose payload sizes depend on the data
VARIANTS = ["powersgd:rank=2,warmup=0", "topk:ratio=0.01,mode=sampled", "topk:ratio=0.01,scope=layer",
            "dgc:ratio=0.01,mode=exact", "sig:ratio=0.01,split=global", "qdist:budget=3", "qdist:bits=3,bucket=0",
            "randomk:ratio=0.05,shared=1", "signsgd:scale=none"]
SPECS = sorted(list_compressors()) + VARIANTS


def _flat_only(spec):
    """Why ``spec`` has no node-aware route, or None."""
    from hvd_ext.spec import compression_from_spec
    comp = compression_from_spec(spec)
    if comp.collective == "allreduce" and not comp.shardable:
        return "payloads that cannot be cut into shards"
    if comp.feedback is not None and not comp.feedback.node_level:
        return f"feedback {comp.feedback.name} needs every rank's own sent mask"
    return None


def _allreduce(spec):
    from hvd_ext.spec import compression_from_spec
    return compression_from_spec(spec).collective == "allreduce"


def _cases():
    for spec in SPECS:
        for N in (2, 3, 4, 8):
            if _allreduce(spec):
                yield pytest.param(spec, N, None, 0, id=f"{spec}-N{N}")
                if N in (4, 8):
                    yield pytest.param(spec, N, None, N // 2, id=f"{spec}-N{N}-node")
                continue
            for mode in ("allgather", "twophase"):
                yield pytest.param(spec, N, mode, 0, id=f"{spec}-N{N}-{mode}")
                if N in (4, 8):
                    yield pytest.param(spec, N, mode, N // 2, id=f"{spec}-N{N}-node-{mode}")


@pytest.fixture(autouse=True)
def _references():
    K.use_reference(True)
    yield
    K.use_reference(False)


@pytest.mark.parametrize("spec,N,mode,per_node", list(_cases()))
def test_sync_budget(spec, N, mode, per_node):
    rep = count_syncs(spec, N, route=mode, shapes=SHAPES, bucket_bytes=BUCKET, steps=2, warm=1,
                      ranks_per_node=per_node, node_model=SLOW_INTER if per_node else None)
    assert rep.buckets >= 2
    if per_node and not all(r.startswith("node:") for r in rep.routes):
        why = _flat_only(spec)
        assert why, f"node-aware not chosen: {rep.routes}"
        pytest.skip(f"{spec}: no node-aware route ({why}); its flat routes are counted in the other cases")
    assert rep.in_hooks == 0, "syncs inside a backward hook:\n" + "\n".join(s for s in rep.sites if "hook" in s)
    assert rep.per_step <= rep.budget, (f"{rep.per_step} syncs per step over a budget of {rep.budget} "
                                        f"({rep.buckets} buckets, routes {rep.routes}):\n" + "\n".join(rep.sites))


def test_budget_does_not_grow_with_tensors_or_ranks():
    """The same buckets with 4 times the tensors, and 8 ranks instead of 2: the same syncs per step."""
    few = count_syncs("topk:ratio=0.01,mode=sampled", 2, shapes=[(4000,)] * 4, bucket_bytes=BUCKET, steps=3, warm=1)
    many = count_syncs("topk:ratio=0.01,mode=sampled", 8, shapes=[(1000,)] * 16, bucket_bytes=BUCKET, steps=3,
                       warm=1)
    assert few.buckets == many.buckets
    assert many.per_step == few.per_step <= few.budget


def test_sparse_reduce_scatter_rebalance_reads_nothing_more(monkeypatch):
    """The owner ranges are rebalanced every 16 steps on the device: that step reads no more."""
    from hvd_ext.exchange.routes import sparse_rs
    monkeypatch.setattr(sparse_rs, "REBALANCE_EVERY", 2)
    rep = count_syncs("topk:ratio=0.05", 4, route="twophase", shapes=SHAPES, bucket_bytes=BUCKET, steps=6, warm=1)
    assert rep.routes == ["sparse_rs"] * rep.buckets and rep.per_step <= rep.budget, rep.sites


@pytest.mark.parametrize("spec", ["none", "fp16", "topk:ratio=0.05", "threshold:tau=1.5", "signsgd:scale=none",
                                  "qsgd:bits=8"])
def test_device_path_gives_the_host_path_results(spec):
    """The pipeline on the emulated GPU computes what it computes on the host (deterministic codecs
    exactly up to float summation order; the stochastic quantizer in distribution: within its
    rounding error)."""
    N = 3
    grads = make_grads(SHAPES, N, 3, seed=4)
    host = run_pipeline(spec, grads, N, bucket_bytes=BUCKET)[0].results[-1]
    dev = count_syncs(spec, N, shapes=SHAPES, bucket_bytes=BUCKET, steps=3, warm=1, seed=4).results[0]
    grads = make_grads(SHAPES, N, 3, seed=4)
    exact = {n: sum(grads[-1][r][n] for r in range(N)) / N for n in host}
    for name, h in host.items():
        if spec.startswith("qsgd"):  # 8 bits: within a level step of a rank's norm (QSGD's l2 scale)
            step = max(float(grads[-1][r][name].norm()) for r in range(N)) / 127
            assert (dev[name] - exact[name]).abs().max() <= step and (h - exact[name]).abs().max() <= step, name
        elif spec == "fp16":  # summed in half precision: equal up to its rounding
            assert torch.allclose(dev[name], h, atol=2e-3 * float(h.abs().max())), name
        else:
            assert torch.allclose(dev[name], h, atol=1e-5), name
