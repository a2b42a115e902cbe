"""The compressors and feedbacks reach the GPU kernels through ``hvd_ext.kernels``, and the
dispatch (automatic for CUDA tensors, forced off by ``use_reference(True)`` or
``HVD_EXT_KERNELS=reference``) is honoured.

No GPU is needed: ``fake_gpu`` makes ``kernels.backend`` treat every tensor as a CUDA tensor
with CuPy present (it replaces the device predicate ``kernels._on_gpu`` and ``_get_cupy``),
and replaces the kernel entry points by recorders that run the torch reference instead of
launching. That drives the compressors' CUDA code paths on CPU tensors: the tests check which
entry points each compressor calls, that the CUDA paths produce valid payloads, and that the
switch sends everything back to the torch path (bit-identical to plain CPU).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hvd_ext import kernels as K
from hvd_ext.compression import bitpack, compression_from_spec
from hvd_ext.compression._sparse import SAMPLED_HIGH, SAMPLED_LOW, count_for
from hvd_ext.compression.base import TensorInfo
from hvd_ext.compression.signsgd import vote_sum

ROOT = Path(__file__).resolve().parents[1]

ENTRY_POINTS = ("pack_bits", "unpack_bits", "select_threshold", "sparse_scatter_add", "quantize_pack",
                "unpack_dequantize_accumulate", "sign_pack", "majority_vote", "residual_update",
                "ewma_update")
# entry points a compressor / feedback calls only on its CUDA path (its CPU path is its own torch code)
CUDA_ONLY = {"select_threshold", "quantize_pack", "majority_vote", "residual_update", "ewma_update"}


@pytest.fixture(autouse=True)
def _auto_dispatch():
    K.use_reference(False)
    yield
    K.use_reference(False)


def _pretend_gpu(monkeypatch, mod=K):
    monkeypatch.setattr(mod, "_on_gpu", lambda t: isinstance(t, torch.Tensor))
    monkeypatch.setattr(mod, "_get_cupy", lambda: object())


@pytest.fixture
def fake_gpu(monkeypatch):
    """Every tensor counts as a CUDA tensor; kernel entry points record their calls and run the
    torch reference. Yields the list of recorded entry-point names."""
    _pretend_gpu(monkeypatch)
    calls = []

    def recorder(name):
        ref = getattr(K, name + "_reference")

        def rec(*a, **kw):
            calls.append(name)
            return ref(*a, **kw)
        return rec

    for name in ENTRY_POINTS:
        monkeypatch.setattr(K, name, recorder(name))
    return calls


class _Launched(Exception):
    pass


def _raising_launcher(monkeypatch, mod=K):
    def launch(t, module, fn, grid, block, args, shared_mem=0):
        raise _Launched(fn)
    monkeypatch.setattr(mod, "_launch", launch)
    monkeypatch.setattr(mod, "_grid", lambda work, dev, per_block=256: 1)


# ---------------------------------------------------------------------------------------------
# the dispatchers themselves
# ---------------------------------------------------------------------------------------------

def _dispatch_cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    big = torch.randn(100_000, generator=g)
    codes = torch.randint(0, 8, (1000,), generator=g).to(torch.uint8)
    packed = bitpack.pack_bits(codes, 3)
    signs = K.sign_pack_reference(x)
    lv = torch.linspace(-3, 3, 8)
    return [
        ("hvd_pack_bits", lambda m: m.pack_bits(codes, 3), lambda: bitpack.pack_bits(codes, 3)),
        ("hvd_unpack_bits", lambda m: m.unpack_bits(packed, 3, 1000), lambda: codes),
        ("hvd_sign_pack", lambda m: m.sign_pack(x), lambda: bitpack.pack_bits((x >= 0).to(torch.uint8), 1)),
        ("hvd_majority_vote", lambda m: m.majority_vote([signs, signs], 1000),
         lambda: torch.where(x >= 0, 1.0, -1.0)),
        ("hvd_quantize_pack", lambda m: m.quantize_pack(x, lv, 1.0, 3, 1, 2),
         lambda: K.quantize_pack_reference(x, lv, 1.0, 3, 1, 2)),
        ("hvd_scatter_add", lambda m: m.sparse_scatter_add(torch.zeros(1000), [torch.arange(5)], [x[:5]]),
         lambda: torch.cat([x[:5], torch.zeros(995)])),
        ("hvd_residual_update", lambda m: m.residual_update(torch.empty(1000), x, x * 0.5), lambda: x - x * 0.5),
        ("hvd_ewma_update", lambda m: m.ewma_update(torch.zeros(1000), x, None, 0.5),
         lambda: K.ewma_update_reference(torch.zeros(1000), x, None, 0.5)),
        ("hvd_sample_abs", lambda m: m.select_threshold(big, 100, 0.01, 3),
         lambda: K.select_threshold_reference(big, 100, 0.01, 3)),
    ]


@pytest.mark.parametrize("kernel,call,expect", _dispatch_cases(), ids=lambda v: v if isinstance(v, str) else None)
def test_dispatcher_launches_kernel_for_gpu_tensors_unless_forced(monkeypatch, kernel, call, expect):
    _pretend_gpu(monkeypatch)
    _raising_launcher(monkeypatch)
    assert K.backend(torch.zeros(1)) == "cuda"
    with pytest.raises(_Launched) as e:         # automatic: the kernel is launched
        call(K)
    assert str(e.value) == kernel
    K.use_reference(True)                        # the switch: torch reference, no launch
    assert K.backend(torch.zeros(1)) == "reference"
    got = call(K)
    want = expect()
    got = got[0] if isinstance(got, tuple) else got
    want = want[0] if isinstance(want, tuple) else want
    assert torch.equal(got, want)


def test_environment_switch_forces_reference(monkeypatch):
    monkeypatch.setenv("HVD_EXT_KERNELS", "reference")  # read at import: load a fresh copy
    spec = importlib.util.spec_from_file_location("_hvd_ext_kernels_env", ROOT / "hvd_ext" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _pretend_gpu(monkeypatch, mod)
    _raising_launcher(monkeypatch, mod)
    assert mod.backend(torch.zeros(1)) == "reference"
    for _, call, expect in _dispatch_cases():
        got, want = call(mod), expect()
        got = got[0] if isinstance(got, tuple) else got
        want = want[0] if isinstance(want, tuple) else want
        assert torch.equal(got, want)
    mod.use_reference(False)                     # sanity: the same copy launches when not forced
    with pytest.raises(_Launched):
        mod.pack_bits(torch.zeros(8, dtype=torch.uint8), 1)


def test_bit_packing_has_one_torch_implementation(monkeypatch):
    calls = []
    real_pack, real_unpack = bitpack.pack_bits, bitpack.unpack_bits
    monkeypatch.setattr(bitpack, "pack_bits", lambda *a, **k: calls.append("pack") or real_pack(*a, **k))
    monkeypatch.setattr(bitpack, "unpack_bits", lambda *a, **k: calls.append("unpack") or real_unpack(*a, **k))
    c = torch.tensor([1, 2, 7, 0, 5], dtype=torch.uint8)
    assert K.pack_bits(c, 3).tolist() == [0xD1, 0x51]
    assert K.unpack_bits(torch.tensor([0xD1, 0x51], dtype=torch.uint8), 3, 5).tolist() == [1, 2, 7, 0, 5]
    assert K.sign_pack(torch.tensor([1.0, -1.0])).tolist() == [1]
    assert calls == ["pack", "unpack", "pack"]
    # only the low `bits` bits of a code are used, as in the kernel (kernels.pack_bits never checks)
    assert torch.equal(K.pack_bits(torch.tensor([9, 15], dtype=torch.uint8), 3),
                       real_pack(torch.tensor([1, 7], dtype=torch.uint8), 3))


# ---------------------------------------------------------------------------------------------
# compressors and feedbacks call the entry points
# ---------------------------------------------------------------------------------------------

WIRING = {
    "topk:ratio=0.01": {"sparse_scatter_add"},
    "topk:ratio=0.01,mode=sampled": {"select_threshold", "sparse_scatter_add", "residual_update"},
    "topk:ratio=0.02,mode=sampled,scope=model": {"select_threshold", "sparse_scatter_add"},
    "topk:ratio=0.01,feedback=ewma": {"sparse_scatter_add", "ewma_update", "residual_update"},
    "threshold:tau=1.5": {"sparse_scatter_add", "residual_update"},
    "dgc:ratio=0.01": {"select_threshold", "sparse_scatter_add", "residual_update"},
    "sig:ratio=0.01,mode=sampled": {"select_threshold", "sparse_scatter_add"},
    "sig:ratio=0.01,mode=sampled,split=global": {"select_threshold", "sparse_scatter_add"},
    "randomk:ratio=0.01": {"sparse_scatter_add", "residual_update"},
    "qsgd": {"quantize_pack", "unpack_bits"},
    "qsgd:bits=3,bucket=0": {"quantize_pack", "unpack_bits"},
    "qdist": {"quantize_pack", "unpack_bits"},
    "qdist:dist=empirical,bits=2": {"quantize_pack", "unpack_bits"},
    "terngrad": {"quantize_pack", "unpack_bits"},
    "int8:stochastic=1": {"quantize_pack"},
    "natural": {"pack_bits", "unpack_bits"},
    "signsgd": {"sign_pack", "majority_vote", "unpack_bits"},
    "signum": {"sign_pack", "majority_vote", "unpack_bits"},
    "signsgd:scale=none": {"sign_pack", "majority_vote", "unpack_bits"},
    "signum:scale=none": {"sign_pack", "majority_vote", "unpack_bits"},
    "efsignsgd": {"sign_pack", "unpack_bits", "residual_update"},
    "onebit": {"sign_pack", "unpack_bits", "residual_update"},
}


def _grads(device="cpu"):
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(40, 50, generator=g).to(device), "b": (torch.randn(3001, generator=g) * 3).to(device)}


def _run(spec, nranks=3, steps=2, device="cpu"):
    """One bucket through compensate / prepare_bucket / compress (all ranks) / aggregate / decode /
    adjust / update / commit, like the pipeline. Returns everything produced (for comparisons)."""
    comp = compression_from_spec(spec)
    fb = comp.feedback
    grads = _grads(device)
    out = {}
    for step in range(steps):
        items = []
        for name, gr in grads.items():
            info = TensorInfo(name=name, shape=gr.shape, step=step, rank=0, size=nranks,
                              param=torch.full(gr.shape, 0.5) + gr.abs() * 0.1)
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
            wb = comp.wire_bytes(info.numel)
            if wb is not None:
                assert all(p.numel() == wb for p in payloads), spec
            key = f"{step}/{info.name}"
            out.update({key + "/payloads": payloads, key + "/agg": agg, key + "/res": res, key + "/sent": sent})
        fb.commit()
        comp.commit()
        out[f"{step}/memory"] = {k: v.clone() for k, v in fb.memory.items()}
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("spec", sorted(WIRING))
def test_compressor_goes_through_kernel_entry_points(fake_gpu, spec):
    _run(spec)
    assert WIRING[spec] <= set(fake_gpu), (spec, WIRING[spec] - set(fake_gpu))


@pytest.mark.parametrize("spec", sorted(WIRING))
def test_use_reference_forces_the_torch_path(fake_gpu, monkeypatch, spec):
    K.use_reference(True)
    forced = _run(spec)
    assert not (set(fake_gpu) & CUDA_ONLY), (spec, set(fake_gpu) & CUDA_ONLY)
    # ... and it computes the plain CPU result, bit for bit
    K.use_reference(False)
    monkeypatch.setattr(K, "_on_gpu", lambda t: False)
    fake_gpu.clear()
    plain = _run(spec)
    assert not (set(fake_gpu) & CUDA_ONLY)
    assert _same(forced, plain), spec


# ---------------------------------------------------------------------------------------------
# the CUDA code paths (run with the references) keep the compressors' semantics
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N", [1, 2, 3, 4, 5])
def test_majority_vote_path_keeps_tie_zero(fake_gpu, N):
    g = torch.Generator().manual_seed(N)
    n = 1001
    xs = [torch.randn(n, generator=g) for _ in range(N)]
    xs[0][:50] = 0.0
    if N >= 2:
        xs[1][:50] = -1.0                        # ties on the first 50 coordinates when N == 2
    datas = [K.sign_pack(x) for x in xs]
    got = vote_sum(datas, n)
    assert "majority_vote" in fake_gpu
    s = sum(torch.where(x >= 0, 1.0, -1.0) for x in xs)
    assert torch.equal(got, torch.sign(s) * N)
    if N % 2 == 0:
        assert bool((got == 0).any())


@pytest.mark.parametrize("spec", ["topk:ratio=0.01,mode=sampled", "dgc:ratio=0.002", "sig:ratio=0.01,mode=sampled"])
def test_sampled_selection_path_bounds(fake_gpu, spec):
    comp = compression_from_spec(spec)
    g = torch.Generator().manual_seed(11)
    for n in (5000, 200_000):
        x = torch.randn(n, generator=g) ** 3
        info = TensorInfo(name="w", shape=x.shape, step=4, rank=1, size=2)
        k = count_for(comp.ratio, n)
        idx = comp.select(x, info)
        assert fake_gpu.count("select_threshold") >= 1
        fake_gpu.clear()
        assert idx.dtype == torch.int64
        assert SAMPLED_LOW * k <= idx.numel() <= SAMPLED_HIGH * k, (n, k, idx.numel())
        assert bool((idx[1:] > idx[:-1]).all())
        if comp.name != "sig":                    # a threshold set of |x|
            rest = torch.ones(n, dtype=torch.bool)
            rest[idx] = False
            assert float(x.abs()[idx].min()) >= float(x.abs()[rest].max())
        again = comp.select(x, info)              # reproducible (counter-based seed)
        assert torch.equal(idx, again)


def _mean_decode_error(comp, x, steps):
    acc = torch.zeros_like(x)
    for step in range(steps):
        info = TensorInfo(name="q", shape=x.shape, step=step, rank=0)
        p, _ = comp.compress(x, info)
        assert p.numel() == comp.wire_bytes(x.numel())
        acc += comp.decode(p, None, info)
    return float((acc / steps - x).abs().mean() / x.abs().mean())


@pytest.mark.parametrize("spec", ["qsgd:bits=4", "qsgd:bits=3,bucket=0", "qdist:bits=3", "qdist:dist=empirical,bits=2",
                                  "terngrad", "int8:stochastic=1"])
def test_quantize_pack_path_unbiased_and_decodable(fake_gpu, spec):
    """The quantize_pack path decodes with the compressor's own decode, and averaging over steps
    converges to x as fast as with the torch path (a wrong level/code mapping would be biased)."""
    comp = compression_from_spec(spec)
    x = torch.randn(2000, generator=torch.Generator().manual_seed(5))
    steps = 100
    err_kernel = _mean_decode_error(comp, x, steps)
    assert fake_gpu.count("quantize_pack") == steps
    K.use_reference(True)
    fake_gpu.clear()
    err_torch = _mean_decode_error(comp, x, steps)
    assert "quantize_pack" not in fake_gpu
    assert err_kernel < 1.3 * err_torch + 1e-3, (spec, err_kernel, err_torch)
    K.use_reference(False)
    # different ranks and steps draw different random numbers; the same ones reproduce
    p0, _ = comp.compress(x, TensorInfo(name="q", shape=x.shape, step=0, rank=0))
    p1, _ = comp.compress(x, TensorInfo(name="q", shape=x.shape, step=0, rank=1))
    p2, _ = comp.compress(x, TensorInfo(name="q", shape=x.shape, step=1, rank=0))
    p0b, _ = comp.compress(x, TensorInfo(name="q", shape=x.shape, step=0, rank=0))
    assert not torch.equal(p0, p1) and not torch.equal(p0, p2) and torch.equal(p0, p0b)


def test_feedback_kernel_paths_match_torch(fake_gpu):
    from hvd_ext.feedback.ewma import EWMAFeedback
    from hvd_ext.feedback.residual import ResidualFeedback
    g = torch.Generator().manual_seed(9)
    u, sent = torch.randn(30, 40, generator=g), torch.randn(30, 40, generator=g)
    fb = ResidualFeedback()
    fb.update("t", u, sent, None)
    assert fake_gpu == ["residual_update"] and torch.equal(fb._pending["t"], u - sent)
    fake_gpu.clear()
    ew = EWMAFeedback(beta=0.7)
    ew.memory["t\x00ewma_S"] = torch.randn(1200, generator=g)
    S = ew.memory["t\x00ewma_S"].clone()
    res = torch.randn(30, 40, generator=g) * (torch.rand(30, 40, generator=g) < 0.3)
    info = TensorInfo(name="t", shape=res.shape, size=2)
    ew.adjust("t", res, info)
    assert "ewma_update" in fake_gpu
    sup = res.reshape(-1) != 0
    assert torch.equal(ew._pending["t\x00ewma_S"], torch.where(sup, S * 0.7 + res.reshape(-1) * (1.0 - 0.7), S))
    assert torch.equal(ew.memory["t\x00ewma_S"], S)      # staged, not in place


# ---------------------------------------------------------------------------------------------
# on a real GPU (skipped elsewhere, with the reason): every wired compressor runs on CUDA tensors
# through the real kernels; where the CPU path is deterministic the results agree
# ---------------------------------------------------------------------------------------------

def _gpu_reason():
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): GPU wiring tests not run"
    if K._get_cupy() is None:
        return f"CuPy not importable ({K._cupy_error}): GPU wiring tests not run"
    return None


GPU_REASON = _gpu_reason()
requires_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
# elementwise-only inputs to the payload: same selection and same bytes on CPU and GPU (the
# aggregated sums may differ in float rounding order only). Not here: codecs whose payload holds a
# reduction (efsignsgd, onebit: a mean) or random draws, and ewma (its S feeds back into u).
# (signsgd/signum: their default scale=l1 payload holds chunk means too; the bare vote is checked)
DETERMINISTIC = {"topk:ratio=0.01", "threshold:tau=1.5", "signsgd:scale=none", "signum:scale=none"}


def _to_cpu(v):
    if isinstance(v, torch.Tensor):
        return v.cpu()
    if isinstance(v, (list, tuple)):
        return [_to_cpu(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_cpu(x) for k, x in v.items()}
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


@requires_gpu
@pytest.mark.parametrize("spec", sorted(WIRING))
def test_gpu_wired_compressors_run(spec):
    assert K.backend(torch.zeros(1, device="cuda")) == "cuda"
    gpu = _to_cpu(_run(spec, device="cuda"))
    for k, v in gpu.items():
        if k.endswith("/agg") or k.endswith("/res"):
            assert bool(torch.isfinite(v).all()), (spec, k)
    if spec in DETERMINISTIC:
        assert _close(gpu, _run(spec)), spec
