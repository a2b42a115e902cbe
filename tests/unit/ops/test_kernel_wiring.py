"""The compressors' device paths reach the GPU kernels through ``hvd_ext.ops.cuda_kernels``, keep the codecs'
semantics, and agree with the host paths where those are deterministic.

No GPU is needed: the device paths run on the emulated GPU of ``hvd_ext.testing.device`` (CPU data
behind tensors that say they are CUDA tensors), with the kernels of kernels/*.cu executed by the CPU
harness (tests/cuda_cpu) -- the ``gpu`` fixture -- or, forced with ``use_reference(True)``, with
their torch references on the device. On a real GPU the same tests run on CUDA tensors.
"""
from __future__ import annotations

import pytest
import torch

from hvd_ext.ops import cuda_kernels as K
from hvd_ext.spec import compression_from_spec
from hvd_ext.compression._sparse import SAMPLED_HIGH, SAMPLED_LOW, count_for
from hvd_ext.compression.base import TensorInfo
from hvd_ext.compression.signsgd import vote_sum

# kernels each compressor's device path launches (the CPU harness counts them)
WIRING = {
    "topk:ratio=0.01": {"hvd_scatter_add"},
    "topk:ratio=0.01,mode=sampled": {"hvd_hist_abs", "hvd_count_ge", "hvd_compact_ge", "hvd_scatter_add",
                                     "hvd_residual_update"},
    "topk:ratio=0.02,mode=sampled,scope=model": {"hvd_hist_abs", "hvd_compact_ge", "hvd_scatter_add"},
    "topk:ratio=0.01,feedback=ewma": {"hvd_scatter_add", "hvd_ewma_update", "hvd_residual_update"},
    "threshold:tau=1.5": {"hvd_compact_ge", "hvd_scatter_add", "hvd_residual_update"},
    "dgc:ratio=0.01": {"hvd_hist_abs", "hvd_compact_ge", "hvd_scatter_add", "hvd_residual_update"},
    "sig:ratio=0.01,mode=sampled": {"hvd_hist_abs", "hvd_compact_ge", "hvd_scatter_add"},
    "sig:ratio=0.01,mode=sampled,split=global": {"hvd_hist_abs", "hvd_compact_ge", "hvd_scatter_add"},
    "randomk:ratio=0.01": {"hvd_scatter_add", "hvd_residual_update"},
    "qsgd": {"hvd_quantize_pack", "hvd_unpack_bits"},
    "qsgd:bits=3,bucket=0": {"hvd_quantize_pack", "hvd_unpack_bits"},
    "qdist": {"hvd_quantize_pack", "hvd_unpack_bits"},
    "qdist:bits=3,bucket=0": {"hvd_quantize_pack", "hvd_unpack_bits"},
    "qdist:dist=empirical,bits=2": {"hvd_quantize_pack", "hvd_unpack_bits"},
    "terngrad": {"hvd_quantize_pack", "hvd_unpack_bits"},
    "int8:stochastic=1": {"hvd_quantize_pack"},
    "natural": {"hvd_pack_bits", "hvd_unpack_bits"},
    "signsgd": {"hvd_sign_pack", "hvd_majority_vote"},
    "signum": {"hvd_sign_pack", "hvd_majority_vote"},
    "signsgd:scale=none": {"hvd_sign_pack", "hvd_majority_vote"},
    "efsignsgd": {"hvd_sign_pack", "hvd_unpack_bits", "hvd_residual_update"},
    "onebit": {"hvd_sign_pack", "hvd_unpack_bits", "hvd_residual_update"},
}
# elementwise payloads: the same selection and the same bytes on the host and on a device (the sums
# may differ in float rounding order only). Not here: codecs whose payload holds a reduction
# (efsignsgd, onebit: a mean) or random draws, and ewma (its S feeds back into u).
DETERMINISTIC = {"topk:ratio=0.01", "threshold:tau=1.5", "signsgd:scale=none"}


@pytest.fixture
def gpu(kdev):
    """The device (``kdev``) with the launches counted when it is the CPU harness."""
    yield kdev


def _grads(put):
    g = torch.Generator().manual_seed(3)
    return {"a": put(torch.randn(40, 50, generator=g)), "b": put(torch.randn(3001, generator=g) * 3)}


def _run(spec, put=lambda t: t, nranks=3, steps=2):
    """One bucket through compensate / prepare_bucket / compress (all ranks) / aggregate / decode /
    adjust / update / commit, like the pipeline. Returns everything produced (for comparisons)."""
    comp = compression_from_spec(spec)
    fb = comp.feedback
    grads = _grads(put)
    out = {}
    for step in range(steps):
        items = []
        for name, gr in grads.items():
            info = TensorInfo(name=name, shape=gr.shape, step=step, rank=0, size=nranks,
                              param=put(torch.full(tuple(gr.shape), 0.5)) + gr.abs() * 0.1)
            items.append((fb.compensate(name, gr * (1 + 0.2 * step), info), info))
        comp.prepare_bucket(items) if hasattr(comp, "prepare_bucket") else None
        for u, info in items:
            payloads = []
            for r in range(nranks):
                ir = TensorInfo(name=info.name, shape=info.shape, step=step, rank=r, size=nranks, param=info.param)
                p, ctx = comp.compress(u if r == 0 else u * (1 - 0.3 * r), ir)
                if r == 0:
                    info.sparse_indices = ir.sparse_indices
                payloads.append(p)
            agg = comp.aggregate(payloads, None, info)
            res = fb.adjust(info.name, agg / nranks, info, comp.support(payloads, None, info))
            sent = comp.local_contribution(payloads[0], None, info, res)
            fb.update(info.name, u, sent.reshape(u.shape), info)
            size = comp.payload_size(info)
            if size is not None:
                assert all(p.numel() == size for p in payloads), spec
            key = f"{step}/{info.name}"
            out.update({key + "/payloads": payloads, key + "/agg": agg, key + "/res": res, key + "/sent": sent})
        fb.commit()
        comp.commit()
        out[f"{step}/memory"] = {k: v.clone() for k, v in fb.memory.items()}
    return out


def _host(v, get):
    if isinstance(v, torch.Tensor):
        return get(v)
    if isinstance(v, (list, tuple)):
        return [_host(x, get) for x in v]
    if isinstance(v, dict):
        return {k: _host(x, get) for k, x in v.items()}
    return v


def _close(a, b):
    if isinstance(a, torch.Tensor):
        if a.dtype == torch.uint8:
            return torch.equal(a, b)
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("spec", sorted(WIRING))
def test_device_path_launches_its_kernels_and_matches_the_references(gpu, spec):
    """On a device each compressor launches its kernels (counted by the CPU harness), and the same
    device path with the kernels forced off (their torch references on the device) gives the same
    results -- bit for bit but for the float atomics of the scatter-add."""
    if gpu.name == "cpu-harness":
        K._runtime.launches.clear()
    got = _host(_run(spec, gpu.put), gpu.get)
    if gpu.name == "cpu-harness":
        assert WIRING[spec] <= set(K._runtime.launches), (spec, WIRING[spec] - set(K._runtime.launches))
    for k, v in got.items():
        if k.endswith("/agg") or k.endswith("/res"):
            assert bool(torch.isfinite(v).all()), (spec, k)
    K.use_reference(True)
    try:
        launches = dict(K._runtime.launches) if gpu.name == "cpu-harness" else None
        ref = _host(_run(spec, gpu.put), gpu.get)
        if launches is not None:
            assert K._runtime.launches == launches  # forced off: nothing launched
    finally:
        K.use_reference(False)
    assert _close(got, ref), spec
    if spec in DETERMINISTIC:  # ... and the host path agrees
        assert _close(got, _run(spec)), spec


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5])
def test_majority_vote_path_keeps_tie_zero(gpu, N):
    g = torch.Generator().manual_seed(N)
    n = 1001
    xs = [torch.randn(n, generator=g) for _ in range(N)]
    xs[0][:50] = 0.0
    if N >= 2:
        xs[1][:50] = -1.0                        # ties on the first 50 coordinates when N == 2
    got = gpu.get(vote_sum([K.sign_pack(gpu.put(x)) for x in xs], n))
    s = sum(torch.where(x >= 0, 1.0, -1.0) for x in xs)
    assert torch.equal(got, torch.sign(s) * N)
    if N % 2 == 0:
        assert bool((got == 0).any())


@pytest.mark.parametrize("spec", ["topk:ratio=0.01,mode=sampled", "dgc:ratio=0.002", "sig:ratio=0.01,mode=sampled"])
def test_sampled_selection_on_a_device_keeps_its_bounds(gpu, spec):
    comp = compression_from_spec(spec)
    g = torch.Generator().manual_seed(11)
    for n in (5000, gpu.n(200_000)):
        x = torch.randn(n, generator=g) ** 3
        info = TensorInfo(name="w", shape=x.shape, step=4, rank=1, size=2)
        k = count_for(comp.ratio, n)
        idx = gpu.get(comp.select(gpu.put(x), info))
        assert idx.dtype == torch.int64
        assert SAMPLED_LOW * k <= idx.numel() <= SAMPLED_HIGH * k, (n, k, idx.numel())
        assert bool((idx[1:] > idx[:-1]).all())
        if comp.name != "sig":                    # a threshold set of |x|
            rest = torch.ones(n, dtype=torch.bool)
            rest[idx] = False
            assert float(x.abs()[idx].min()) >= float(x.abs()[rest].max())
        assert torch.equal(idx, gpu.get(comp.select(gpu.put(x), info)))  # reproducible


def _mean_decode_error(comp, x, steps, put, get):
    acc = torch.zeros_like(x)
    for step in range(steps):
        info = TensorInfo(name="q", shape=x.shape, step=step, rank=0)
        p, _ = comp.compress(put(x), info)
        assert p.numel() == comp.wire_bytes(x.numel())
        acc += get(comp.decode(p, None, info))
    return float((acc / steps - x).abs().mean() / x.abs().mean())


@pytest.mark.parametrize("spec", ["qsgd:bits=4", "qsgd:bits=3,bucket=0", "qdist:bits=3", "qdist:bits=3,bucket=0",
                                  "qdist:dist=empirical,bits=2", "terngrad", "int8:stochastic=1"])
def test_quantize_path_on_a_device_unbiased_and_decodable(gpu, spec):
    """The device path decodes with the compressor's own decode, and averaging over steps converges
    to x as fast as on the host (a wrong level/code mapping would be biased)."""
    comp = compression_from_spec(spec)
    x = torch.randn(2000, generator=torch.Generator().manual_seed(5))
    steps = 60
    err_device = _mean_decode_error(comp, x, steps, gpu.put, gpu.get)
    err_host = _mean_decode_error(comp, x, steps, lambda t: t, lambda t: t)
    assert err_device < 1.3 * err_host + 1e-3, (spec, err_device, err_host)
    # different ranks and steps draw different random numbers; the same ones reproduce
    p0 = gpu.get(comp.compress(gpu.put(x), TensorInfo(name="q", shape=x.shape, step=0, rank=0))[0])
    p1 = gpu.get(comp.compress(gpu.put(x), TensorInfo(name="q", shape=x.shape, step=0, rank=1))[0])
    p2 = gpu.get(comp.compress(gpu.put(x), TensorInfo(name="q", shape=x.shape, step=1, rank=0))[0])
    p0b = gpu.get(comp.compress(gpu.put(x), TensorInfo(name="q", shape=x.shape, step=0, rank=0))[0])
    assert not torch.equal(p0, p1) and not torch.equal(p0, p2) and torch.equal(p0, p0b)


def test_feedback_device_paths_match_the_host(gpu):
    from hvd_ext.feedback.ewma import EWMAFeedback
    from hvd_ext.feedback.residual import ResidualFeedback
    g = torch.Generator().manual_seed(9)
    u, sent = torch.randn(30, 40, generator=g), torch.randn(30, 40, generator=g)
    fb = ResidualFeedback()
    fb.update("t", gpu.put(u), gpu.put(sent), None)
    assert torch.equal(gpu.get(fb._pending["t"]), u - sent)
    S = torch.randn(1200, generator=g)
    res = torch.randn(30, 40, generator=g) * (torch.rand(30, 40, generator=g) < 0.3)
    info = TensorInfo(name="t", shape=res.shape, size=2)
    host, dev = EWMAFeedback(beta=0.7), EWMAFeedback(beta=0.7)
    host.memory["t\x00ewma_S"] = S.clone()
    dev.memory["t\x00ewma_S"] = gpu.put(S.clone())
    a = host.adjust("t", res, info)
    b = gpu.get(dev.adjust("t", gpu.put(res), info))
    assert torch.equal(a, b)
    assert torch.equal(gpu.get(dev._pending["t\x00ewma_S"]), host._pending["t\x00ewma_S"])
    assert torch.equal(gpu.get(dev.memory["t\x00ewma_S"]), S)      # staged, not in place
