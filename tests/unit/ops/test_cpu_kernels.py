"""Properties of the fast CPU codec paths (``hvd_ext.ops.cpu_kernels``): the counter hash, the
word-parallel bit packing, the chunked float32 sum, and that compiled kernels (inductor) compute
what the eager functions compute. Speed itself is measured by benchmarks/throughput.py, not here."""
from __future__ import annotations

import pytest
import torch

from hvd_ext.compression.base import TensorInfo
from hvd_ext.ops import bits as bitpack
from hvd_ext.ops import cpu_kernels as cpu_k
from hvd_ext.ops import cuda_kernels as K
from hvd_ext.spec import compression_from_spec


def test_uniform_is_the_kernels_counter_hash():
    key = cpu_k.stream_key_tensor(3, "layer.weight", 1, 17)
    key_int = K.stream_key(K.derive_seed(3, "layer.weight", 1), 17)
    for n in (10007, 70001):  # the whole-tensor and the in-place eager forms
        ours = cpu_k.uniform(n, key)
        ref = K.uniform(key_int, torch.arange(n, dtype=torch.int64))
        assert torch.equal(ours, ref)
    assert 0 <= float(ours.min()) and float(ours.max()) < 1
    assert abs(float(ours.mean()) - 0.5) < 0.01


@pytest.mark.parametrize("bits", range(1, 9))
def test_word_packing_follows_the_bit_order_contract(bits):
    g = torch.Generator().manual_seed(bits)
    for n in (1, 5, 8, 9, 63, 64, 1001):
        codes = torch.randint(0, 2 ** bits, (n,), generator=g).to(torch.uint8)
        buf = cpu_k.codes_buffer("test", n, "cpu")
        buf[:n].copy_(codes)
        packed = cpu_k.pack_buffer(buf, n, bits)
        ref = bitpack.pack_bits(codes, bits)
        assert torch.equal(packed, ref), (bits, n)
        assert torch.equal(cpu_k.unpack_to_buffer(ref, bits, n, "test/u"), codes)
        shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), ref])[3:]  # unaligned storage
        assert torch.equal(cpu_k.unpack_to_buffer(shifted, bits, n, "test/u"), codes)


SPECS = ["qsgd:bits=4", "qsgd:bits=8", "qsgd:bits=3,bucket=0", "terngrad", "int8", "int8:stochastic=1",
         "signsgd", "signsgd:scale=none", "efsignsgd", "onebit", "qdist:bits=3", "qdist:bits=2,dist=empirical"]


def _round_trip(spec, x):
    comp = compression_from_spec(spec)
    infos = [TensorInfo(name="w", shape=x.shape, step=4, rank=r, size=2) for r in range(2)]
    payloads = [comp.compress(x * (1 + r), i)[0] for r, i in enumerate(infos)]
    return payloads, comp.aggregate(payloads, None, infos[0]), comp.decode(payloads[0], None, infos[0])


@pytest.fixture
def compiled(monkeypatch):
    try:
        torch.compile(lambda t: t + 1)(torch.ones(3))
    except Exception as e:  # no C++ compiler here: the eager path is all there is
        pytest.skip(f"torch.compile unavailable: {e}")
    monkeypatch.setattr(cpu_k, "_SETTING", "1")
    yield
    monkeypatch.setattr(cpu_k, "_SETTING", "0")


@pytest.mark.parametrize("spec", SPECS)
def test_compiled_kernels_compute_the_eager_result(compiled, monkeypatch, spec):
    x = torch.distributions.Laplace(0.0, 1e-2).sample((3 * 4096 + 5,))
    p_c, agg_c, dec_c = _round_trip(spec, x)
    monkeypatch.setattr(cpu_k, "_SETTING", "0")
    p_e, agg_e, dec_e = _round_trip(spec, x)
    for a, b in zip(p_c, p_e):
        assert a.numel() == b.numel()
        # float reductions (norms, means) may round differently compiled: their bytes, and rarely a
        # code next to a rounding boundary, differ; the decoded values below must agree
        assert (a != b).float().mean() < 0.05, spec
    scale = float(agg_e.abs().max()) + 1e-12
    assert float((agg_c - agg_e).abs().max()) <= 1e-3 * scale, spec
    assert float((dec_c - dec_e).abs().max()) <= 1e-3 * scale, spec


@pytest.mark.parametrize("spec", ["qsgd:bits=4", "terngrad", "int8:stochastic=1", "qdist:bits=3"])
def test_counter_hash_rounding_is_unbiased(spec):
    """Mean over steps (independent streams) of the decoded value approaches the input."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2000, generator=g) * 0.01
    comp = compression_from_spec(spec + ("" if spec == "int8:stochastic=1" else ""))
    if spec == "terngrad":
        comp = compression_from_spec("terngrad:clip=0")
    acc = torch.zeros_like(x)
    steps = 400
    for step in range(steps):
        info = TensorInfo(name="w", shape=x.shape, step=step, rank=0, size=1)
        acc += comp.decode(comp.compress(x, info)[0], None, info)
    err = (acc / steps - x).abs().mean() / x.abs().mean()
    assert err < 0.1, (spec, float(err))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_chunked_float32_sum_equals_the_plain_sum(dtype, ranks, monkeypatch):
    """``sum_float32`` (the Exchange's float16 / bfloat16 reduction) gives, bit for bit, the plain
    ``rows[0].float() + rows[1] + ...`` times the scale, at every chunk boundary, into a float32
    or (re-rounded) half-precision output; and its scratch chunk is reused, not re-allocated."""
    monkeypatch.setattr(cpu_k, "SUM_CHUNK", 1000)
    g = torch.Generator().manual_seed(ranks)
    for n in (0, 1, 999, 1000, 1001, 4567):
        rows = [(torch.randn(n, generator=g) * 10 ** float(torch.randint(-6, 3, (1,), generator=g))).to(dtype)
                for _ in range(ranks)]
        ref = rows[0].float()
        for r in rows[1:]:
            ref.add_(r)
        ref.mul_(0.25)
        assert torch.equal(cpu_k.sum_float32(rows, 0.25), ref)
        assert torch.equal(cpu_k.sum_float32(rows, 0.25, torch.empty(n, dtype=dtype)), ref.to(dtype))
    buf = cpu_k.scratch("sum_float32", 1000, torch.float32, "cpu")
    cpu_k.sum_float32([torch.ones(2500, dtype=dtype)] * 2, 1.0, torch.empty(2500, dtype=torch.float16))
    assert cpu_k.scratch("sum_float32", 1000, torch.float32, "cpu").data_ptr() == buf.data_ptr()
