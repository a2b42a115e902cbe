"""Quantization and low-rank family: bit packing, qsgd, terngrad, signsgd, efsignsgd,
signum, onebit, natural, int8, powersgd, qdist."""
import math

import pytest
import torch

from hvd_ext.spec import compression_from_spec as C
from hvd_ext.compression.base import Continue, TensorInfo
from hvd_ext.ops.bits import pack_bits, packed_bytes, unpack_bits
from hvd_ext.compression.qdist_levels import level_table
from hvd_ext.feedback.residual import ResidualFeedback


def info(name, shape, step=0, rank=0):
    return TensorInfo(name=name, shape=torch.Size(shape), step=step, rank=rank)


def roundtrip(comp, x, step=0, name="w", rank=0):
    i = info(name, x.shape, step, rank)
    payload, ctx = comp.compress(x, i)
    return payload, comp.decode(payload, ctx, i)


# ---- bit packing ---------------------------------------------------------------------------

@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 8, 9, 63, 1000):
        codes = torch.randint(0, 2 ** bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
        if n:
            codes[0] = 2 ** bits - 1  # the largest code survives
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_bytes(n, bits) == math.ceil(n * bits / 8)
        assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_bit_order_contract():
    # 3-bit codes 1,2,3,4,5: stream bits (LSB of each code first)
    # 100 010 110 001 101 -> byte0 = bits 0..7 = 1,0,0,0,1,0,1,1 = 209; byte1 = 0,0,0,1,1,0,1,0 = 88
    assert pack_bits(torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8), 3).tolist() == [209, 88]
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).tolist() == [13, 1]
    assert pack_bits(torch.tensor([0x3, 0xA, 0xF], dtype=torch.uint8), 4).tolist() == [0xA3, 0x0F]
    assert pack_bits(torch.tensor([3, 1, 2, 0, 1], dtype=torch.uint8), 2).tolist() == [0b00100111, 0b01]
    # 7-bit: code0 = 0x7F fills bits 0..6, code1 = 1 sets stream bit 7
    assert pack_bits(torch.tensor([0x7F, 1], dtype=torch.uint8), 7).tolist() == [0xFF, 0x00]
    assert unpack_bits(torch.tensor([209, 88], dtype=torch.uint8), 3, 5).tolist() == [1, 2, 3, 4, 5]


def test_pack_bad_arguments():
    c = torch.tensor([1, 2], dtype=torch.uint8)
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError):
            pack_bits(c, bad)
    with pytest.raises(ValueError):
        pack_bits(torch.tensor([4], dtype=torch.uint8), 2)  # code >= 2**bits
    with pytest.raises(ValueError):
        pack_bits(torch.tensor([0.5]), 2)
    with pytest.raises(ValueError):
        unpack_bits(torch.tensor([1], dtype=torch.uint8), 3, 5)  # too short


# ---- unbiasedness ------------------------------------------------------------------------

UNBIASED = ["qsgd:bits=3", "qsgd:levels=2,bucket=16,norm=linf", "terngrad:clip=0", "natural", "qdist:bits=2",
            "qdist:bits=3,dist=laplace", "qdist:bits=2,dist=empirical", "qdist:bits=4,bucket=16,dist=empirical",
            "qdist:bits=6,bucket=16", "qdist:bits=2,bucket=0",
            "qdist:bits=3,dist=laplace,bucket=0", "qdist:bits=2,dist=empirical,bucket=0", "int8:stochastic=1,chunk=16"]


@pytest.mark.parametrize("spec", UNBIASED)
def test_unbiased(spec):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, generator=g) * torch.linspace(0.1, 3.0, 48)
    x[5] = 0.0
    comp = C(spec)
    outs = torch.stack([roundtrip(comp, x, step=s)[1] for s in range(2000)])
    std = outs.std(0)
    assert std.max() > 0  # really random
    # a coordinate next to a level is rounded the same way almost always; its sample std
    # can be 0 by chance, so the standard error gets a floor of 1/10 of the typical one
    se = torch.maximum(std, 0.1 * std.median()) / math.sqrt(outs.shape[0])
    # a two-point coordinate with a rare outcome (p near 0 or 1, common with levels fitted to the data)
    # has its std underestimated whenever the rare outcome came up less often than expected: take the
    # Agresti-Coull estimate at z = 4 (z^2/2 = 8 pseudo-draws of each outcome) as a floor there
    N = outs.shape[0]
    lo, hi = outs.min(0).values, outs.max(0).values
    two_point = ((outs == lo) | (outs == hi)).all(0)
    pt = ((outs == hi).sum(0).double() + 8) / (N + 16)
    se_ac = ((hi - lo).double() * torch.sqrt(pt * (1 - pt) / N)).float()
    se = torch.where(two_point, torch.maximum(se, se_ac), se)
    mean = outs.mean(0)
    assert bool(((mean - x).abs() <= 4 * se + 1e-6 * (1 + x.abs())).all()), (spec, (mean - x).abs().max())


def test_reproducible_and_step_dependent():
    x = torch.randn(300)
    for spec in ("qsgd", "terngrad", "natural", "qdist"):
        a, _ = roundtrip(C(spec), x, step=3)
        b, _ = roundtrip(C(spec), x, step=3)
        c, _ = roundtrip(C(spec), x, step=4)
        d, _ = roundtrip(C(spec), x, step=3, rank=1)
        assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d), spec


# ---- qdist vs qsgd at equal bits ----------------------------------------------------------

def _rel_mse(spec, x):
    _, d = roundtrip(C(spec), x, name="layer")
    return float(((d - x) ** 2).mean() / (x ** 2).mean())


@pytest.mark.parametrize("shape", ["gaussian", "laplace"])
@pytest.mark.parametrize("bucket", [256, 0])
def test_qdist_beats_qsgd(shape, bucket):
    g = torch.Generator().manual_seed(11)
    n = 16384
    if shape == "gaussian":
        x = torch.randn(n, generator=g) * 0.01
    else:
        u = torch.rand(n, generator=g) - 0.5
        x = -0.01 * torch.sign(u) * torch.log1p(-2 * u.abs())  # Laplace(0, 0.01)
    for b in (2, 3, 4):
        spec = f"qdist:bits={b},bucket={bucket}"
        q = _rel_mse(spec, x)
        qsgd = _rel_mse(f"qsgd:bits={b}", x)  # the paper's L2 norm, buckets of 512
        qsgd_inf = _rel_mse(f"qsgd:bits={b},norm=linf", x)  # stronger variant
        assert q < qsgd and q < qsgd_inf, (shape, b, q, qsgd, qsgd_inf)
        # equal bits: qdist's payload is not larger
        assert C(spec).wire_bytes(n) <= C(f"qsgd:bits={b}").wire_bytes(n)


def _heavy_tailed(n=65536, rows=256, seed=12):
    """Rows (output channels) with log-normal scales and Student-t(3) entries: a heavy-tailed
    layer gradient whose magnitude varies inside the layer, like real ones."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    chi = torch.randn(n, 3, generator=g).pow(2).sum(1)  # chi^2 with 3 degrees of freedom
    t = z / (chi / 3).sqrt()
    row_scale = torch.exp(1.5 * torch.randn(rows, generator=g)).repeat_interleave(n // rows)
    return 1e-3 * t * row_scale


@pytest.mark.parametrize("b", [2, 3, 4])
def test_qdist_beats_every_qsgd_linf_bucket_at_equal_wire_bytes(b):
    """The bucket format (per-bucket scale, per-layer fitted levels) has a lower error than QSGD with
    the max norm at *any* bucket size whose payload is at least as large, on a heavy-tailed layer."""
    x = _heavy_tailed()
    n = x.numel()
    q = _rel_mse(f"qdist:bits={b}", x)
    qbytes = C(f"qdist:bits={b}").wire_bytes(n)
    for bucket in (64, 128, 256, 512, 1024, 0):
        spec = f"qsgd:bits={b},norm=linf,bucket={bucket}"
        if C(spec).wire_bytes(n) >= qbytes:
            assert q < _rel_mse(spec, x), (b, bucket, q, _rel_mse(spec, x))
    # and by a margin against QSGD's own default bucket
    assert q < 0.75 * _rel_mse(f"qsgd:bits={b},norm=linf", x)


def test_qdist_bucket_scales_cover_and_decode():
    from hvd_ext.compression.qdist_levels import bucket_scale_codes, bucket_scales
    x = _heavy_tailed(4096, 16)
    x[100:200] = 0.0  # an all-zero bucket (bucket 256 would be half zero)
    v = x.view(-1, 64)
    amax = v.abs().amax(1)
    amax[3] = 0.0
    M = float(amax.max())
    codes = bucket_scale_codes(amax, M)
    s = bucket_scales(codes, torch.tensor(M))
    assert int(codes[3]) == 255 and float(s[3]) == 0.0
    nz = amax > 0
    assert bool((s[nz] >= amax[nz]).all()) and bool((s[nz] <= amax[nz] * 2 ** (1 / 16) * 1.0001).all())
    assert float(s[int(amax.argmax())]) == M
    # tiny buckets next to a huge one keep a scale that covers them (floor of the code range)
    a = torch.tensor([1.0, 1e-12, 3e-6])
    sa = bucket_scales(bucket_scale_codes(a, 1.0), torch.tensor(1.0))
    assert bool((sa >= a).all())


def test_qdist_fitted_levels_are_optimal_on_the_grid():
    """dp_levels returns the exact minimum of the sampled stochastic-rounding error over level sets
    on its grid: compare with exhaustive search for 4 levels."""
    from hvd_ext.compression.qdist_levels import dp_levels, fit_edges
    E = fit_edges().numel() - 1
    g = torch.Generator().manual_seed(5)
    z = (torch.randn(3000, generator=g) * 0.2).clamp(-1, 1)
    z[:5] = torch.tensor([-1.0, 1.0, 0.0, 0.9, -0.7])
    w = torch.rand(3000, generator=g) + 0.1
    e = fit_edges()
    idx = dp_levels(z, w, 4)
    assert idx.numel() == 4 and int(idx[0]) == 0 and int(idx[-1]) == E and bool((idx[1:] > idx[:-1]).all())

    def err(lv):
        zz, ww = z.double(), w.double()
        i = (torch.searchsorted(lv, zz, right=True) - 1).clamp(0, lv.numel() - 2)
        return float((ww * (zz - lv[i]) * (lv[i + 1] - zz)).sum())

    best = err(e[idx])
    cand = torch.arange(1, E)  # exhaustive over pairs: none beats the DP
    for i in cand.tolist():
        for j in cand[cand > i].tolist():
            assert err(torch.stack([e[0], e[i], e[j], e[-1]])) >= best - 1e-9
    # fitted levels beat uniform ones on the sample
    assert best < err(torch.linspace(-1, 1, 4, dtype=torch.float64))


def test_qdist_bucket_format_bytes_and_degenerate():
    comp = C("qdist:bits=3")
    # header: b, 16 + form, k, M; fitted (form 2) on a large layer: 6 level bytes, then a byte per bucket
    x = _heavy_tailed(4096, 16)
    p, _ = comp.compress(x, info("w", x.shape))
    assert int(p[0]) == 3 and int(p[1]) == 18 and p.numel() == 8 + 6 + 16 + 4096 * 3 // 8
    # a small layer (n b < 64 (K - 2)) gets a table (form 0/1) and no level bytes
    y = x[:100].clone()
    p, _ = comp.compress(y, info("w", y.shape))
    assert int(p[1]) in (16, 17) and p.numel() == 8 + 1 + math.ceil(300 / 8)
    # a non-finite gradient decodes to non-finite values (the step is skipped everywhere)
    y[7] = float("nan")
    assert not bool(torch.isfinite(roundtrip(comp, y)[1]).all())
    y[7] = float("inf")
    assert not bool(torch.isfinite(roundtrip(comp, y)[1]).all())
    # the header is checked: a legacy payload is refused by a bucket decoder
    legacy = C("qdist:bits=3,bucket=0")
    p, _ = legacy.compress(x, info("w", x.shape))
    with pytest.raises(ValueError):
        comp.decode(p, None, info("w", x.shape))


def test_qdist_bucket_fused_aggregate_matches_decode_sum():
    comp = C("qdist:bits=3,bucket=64")
    x = torch.randn(4133, generator=torch.Generator().manual_seed(8))  # a partial last bucket
    i = [info("w", x.shape, step=1, rank=r) for r in range(3)]
    ps = [comp.compress(x * (r + 1), i[r])[0] for r in range(3)]
    dense = sum(comp.decode(p, None, i[0]) for p in ps)
    assert torch.allclose(comp.aggregate(ps, None, i[0]), dense, rtol=1e-6, atol=1e-7)


def test_qdist_picks_shape_and_levels():
    g = torch.Generator().manual_seed(1)
    comp = C("qdist")
    assert comp.fit(torch.randn(20000, generator=g))[0] == "gaussian"
    u = torch.rand(20000, generator=g) - 0.5
    assert comp.fit(-torch.sign(u) * torch.log1p(-2 * u.abs()))[0] == "laplace"
    levels, J = level_table("gaussian", 3, 40)
    assert levels.numel() == 8 and bool((levels[1:] > levels[:-1]).all())
    assert torch.allclose(levels, -levels.flip(0))
    # optimal inner levels beat uniform ones on the same range (J is the expected error)
    from hvd_ext.compression.qdist_levels import _interval_error
    uni = torch.linspace(float(levels[0]), float(levels[-1]), 8, dtype=torch.float64)
    assert J < float(_interval_error("gaussian", uni[:-1], uni[1:]).sum())
    assert level_table("gaussian", 3, 40) is level_table("gaussian", 3, 40)  # cached


@pytest.mark.parametrize("spec", ["qdist:bits=3", "qdist:bits=3,bucket=0", "qdist:bits=2,dist=empirical,bucket=4"])
def test_qdist_degenerate_inputs(spec):
    comp = C(spec)
    for x in (torch.zeros(10), torch.full((7,), 0.25), torch.tensor([3.0]), torch.zeros(0)):
        p, d = roundtrip(comp, x)
        assert p.numel() == comp.wire_bytes(x.numel())
        assert torch.equal(d, x)


def test_qdist_budget_allocation():
    comp = C("qdist:budget=3")
    g = torch.Generator().manual_seed(2)
    big = torch.randn(4000, generator=g)           # large variance: should get more bits
    small = 1e-3 * torch.randn(4000, generator=g)
    items = [(big, info("big", big.shape, step=5)), (small, info("small", small.shape, step=5))]
    comp.prepare_bucket(items)
    bits = {k: b for k, (s, b) in comp._alloc.items()}
    # 1e6 x the variance: every spare bit goes to "big" (1 + 4 = 5 bits), "small" keeps 1
    assert bits == {"big": 5, "small": 1}
    assert sum(bits[k] * 4000 for k in bits) <= 3 * 8000
    for u, i in items:
        p, ctx = comp.compress(u, i)
        assert p.numel() == comp.payload_bytes(4000, bits[i.name])
        d = comp.decode(p, ctx, i)
        assert d.shape == u.shape
    p, ctx = comp.compress(big, items[0][1])
    assert float(((comp.decode(p, ctx, items[0][1]) - big) ** 2).mean()) < 0.02 * float((big ** 2).mean())
    # equal shapes and scales share the budget equally; without prepare_bucket: floor(budget)
    twin = 1.0 * big
    comp.prepare_bucket([(big, info("a", big.shape, step=6)), (twin, info("b", big.shape, step=6))])
    assert comp._alloc["a"] == (6, 3) and comp._alloc["b"] == (6, 3)
    assert comp.bits_for(info("a", big.shape, step=7)) == 3 and C("qdist:budget=2.5").bits_for(info("z", (3,))) == 2
    assert comp.wire_bytes(100) is None and not comp.fixed_size


# ---- wire bytes equal the docstring formulas ----------------------------------------------

def _formula(spec, n):
    cb = lambda b: math.ceil(n * b / 8)  # noqa: E731
    return {
        "qsgd": 4 * math.ceil(n / 512) + cb(4),
        "qsgd:bits=8,bucket=0": 4 + cb(8),
        "qsgd:levels=2,bucket=100": 4 * math.ceil(n / 100) + cb(3),
        "terngrad": 4 + cb(2),
        "signsgd": 4 * math.ceil(n / 128) + cb(1),
        "signum": 4 * math.ceil(n / 128) + cb(1),
        "signsgd:scale=none": cb(1),
        "signum:scale=none": cb(1),
        "signsgd:bucket=0": 4 + cb(1),
        "efsignsgd": 4 * math.ceil(n / 1024) + cb(1),
        "efsignsgd:bucket=0": 4 + cb(1),
        "efsignsgd:bucket=100": 4 * math.ceil(n / 100) + cb(1),
        "onebit": 8 * math.ceil(n / 1024) + cb(1),
        "onebit:bucket=0": 8 + cb(1),
        "onebit:bucket=100": 8 * math.ceil(n / 100) + cb(1),
        "natural": cb(1) + n,
        "int8": 8 * math.ceil(n / 1024) + n,
        "int8:chunk=0": 8 + n,
        "qdist": 8 + (6 if 3 * n >= 64 * 6 else 0) + math.ceil(n / 256) + cb(3),
        "qdist:bits=4,bucket=100": 8 + (14 if 4 * n >= 64 * 14 else 0) + math.ceil(n / 100) + cb(4),
        "qdist:bits=5,dist=laplace": 8 + math.ceil(n / 256) + cb(5),
        "qdist:bits=2,dist=empirical": 8 + 2 + math.ceil(n / 256) + cb(2),
        "qdist:bucket=0": 12 + cb(3),
        "qdist:bits=5,dist=laplace,bucket=0": 12 + cb(5),
        "qdist:bits=2,dist=empirical,bucket=0": 4 + 16 + cb(2),
    }[spec]


@pytest.mark.parametrize("spec", ["qsgd", "qsgd:bits=8,bucket=0", "qsgd:levels=2,bucket=100", "terngrad",
                                  "signsgd", "signum", "signsgd:scale=none", "signum:scale=none",
                                  "signsgd:bucket=0", "efsignsgd", "onebit", "natural", "int8",
                                  "efsignsgd:bucket=0", "efsignsgd:bucket=100", "onebit:bucket=0",
                                  "onebit:bucket=100", "int8:chunk=0", "qdist", "qdist:bits=5,dist=laplace",
                                  "qdist:bits=2,dist=empirical", "qdist:bits=4,bucket=100", "qdist:bucket=0",
                                  "qdist:bits=5,dist=laplace,bucket=0", "qdist:bits=2,dist=empirical,bucket=0"])
def test_wire_bytes(spec):
    comp = C(spec)
    for n in (1, 9, 1000, 3001):
        x = torch.randn(n)
        p, d = roundtrip(comp, x)
        assert p.dtype == torch.uint8 and p.numel() == comp.wire_bytes(n) == _formula(spec, n), (spec, n)
        assert d.shape == (n,) and torch.isfinite(d).all()


def test_decoded_values():
    x = torch.tensor([3.0, -1.0, 0.5, -0.25, 0.0, 6.0])
    _, d = roundtrip(C("signsgd:scale=none"), x)
    assert d.tolist() == [1, -1, 1, -1, 1, 1]
    _, d = roundtrip(C("signsgd"), x)  # default scale=l1: sign times the chunk's mean |x|
    assert torch.allclose(d, torch.tensor([1, -1, 1, -1, 1, 1.0]) * x.abs().mean())
    _, d = roundtrip(C("efsignsgd"), x)
    assert torch.allclose(d, torch.tensor([1, -1, 1, -1, 1, 1.0]) * x.abs().mean())
    _, d = roundtrip(C("onebit"), x)
    pos = x[x >= 0].mean()
    neg = x[x < 0].mean()
    assert torch.allclose(d, torch.where(x >= 0, pos, neg))
    # per-chunk scales: chunks [0:4] and [4:6]
    _, d = roundtrip(C("efsignsgd:bucket=4"), x)
    scale = torch.tensor([x[:4].abs().mean()] * 4 + [x[4:].abs().mean()] * 2)
    assert torch.allclose(d, torch.tensor([1, -1, 1, -1, 1, 1.0]) * scale)
    _, d = roundtrip(C("onebit:bucket=4"), x)
    ref = torch.cat([torch.where(c >= 0, c[c >= 0].mean(), c[c < 0].mean() if (c < 0).any() else 0.0)
                     for c in (x[:4], x[4:])])
    assert torch.allclose(d, ref)
    _, d = roundtrip(C("natural"), x)
    nz = d[d != 0].abs()
    assert torch.equal(nz, 2.0 ** torch.log2(nz).round())  # powers of two
    assert (d.sign() == x.sign()).all() and ((d.abs() >= x.abs() / 2) & (d.abs() <= 2 * x.abs())).all()
    _, d = roundtrip(C("int8"), torch.linspace(-1, 1, 256))
    assert (d - torch.linspace(-1, 1, 256)).abs().max() <= 1 / 255 + 1e-6
    _, d = roundtrip(C("terngrad:clip=0"), x)
    assert set(d.tolist()) <= {0.0, 6.0, -6.0}
    x = torch.randn(1000)
    for spec, s_ in (("qsgd:bits=8,bucket=0", 127), ("qsgd:levels=3,bucket=0", 3)):
        _, d = roundtrip(C(spec), x)
        # Alistarh et al. Lemma 3.1: E||Q(v) - v||^2 <= min(n / s^2, sqrt(n) / s) ||v||^2
        assert float(((d - x) ** 2).sum()) <= min(1000 / s_ ** 2, 1000 ** 0.5 / s_) * float((x ** 2).sum())
        levels = (d.abs() / x.norm() * s_)
        assert torch.allclose(levels, levels.round(), atol=1e-3)  # on the grid norm * l / s


def test_terngrad_clip_bounds_scaler():
    x = torch.randn(1000)
    x[0] = 100.0
    _, d = roundtrip(C("terngrad:clip=2.5"), x)
    assert d.abs().max() <= 2.5 * x.std() + 1e-4


# ---- error feedback: sent + remembered = input ---------------------------------------------

@pytest.mark.parametrize("spec", ["efsignsgd", "onebit"])
def test_error_feedback_conserves(spec):
    comp = C(spec)
    fb = comp.feedback
    assert isinstance(fb, ResidualFeedback)
    g = torch.Generator().manual_seed(3)
    total_in, total_sent = torch.zeros(200), torch.zeros(200)
    for step in range(5):
        grad = torch.randn(200, generator=g)
        i = info("w", grad.shape, step)
        u = fb.compensate("w", grad, i)
        p, ctx = comp.compress(u, i)
        sent = comp.local_contribution(p, ctx, i, None)
        fb.update("w", u, sent, i)
        fb.commit()
        total_in += grad
        total_sent += sent
    assert torch.allclose(total_sent + fb.memory["w"], total_in, atol=1e-4)


def test_signum_momentum_state():
    comp = C("signum:beta=0.5")
    g1, g2 = torch.tensor([1.0, -1.0, 2.0]), torch.tensor([-3.0, 0.5, -1.0])
    roundtrip(comp, g1, step=0)
    comp.commit()
    state = comp.state_dict()
    # a skipped step (non-finite somewhere) leaves the momentum as it was
    roundtrip(comp, torch.tensor([float("nan"), 1.0, 1.0]), step=1)
    comp.discard()
    assert torch.equal(comp.momentum["w"], state["momentum"]["w"])
    _, d = roundtrip(comp, g2, step=1)
    comp.commit()
    # m = 0.5*(0.5*g1) + 0.5*g2 = [-1.25, 0, 0]  -> signs (>= 0 -> +)
    assert torch.allclose(comp.momentum["w"], torch.tensor([-1.25, 0.0, 0.0]))
    # default scale=l1: signs times mean|m| / (1 - beta) = (1.25 / 3) / 0.5
    assert torch.allclose(d, torch.tensor([-1.0, 1.0, 1.0]) * (1.25 / 3) / 0.5)
    _, bare = roundtrip(C("signum:beta=0.5,scale=none"), g2, step=0)
    assert bare.tolist() == [-1, 1, -1]  # scale=none: the bare signs of m = 0.5 * g2
    other = C("signum:beta=0.5")
    other.load_state_dict(state)
    _, d2 = roundtrip(other, g2, step=1)
    other.commit()
    assert torch.equal(d, d2) and torch.equal(other.momentum["w"], comp.momentum["w"])


# ---- PowerSGD ------------------------------------------------------------------------------

def powersgd_round(comps, mats, name="m", step=0):
    """Simulate the pipeline's allreduce(Average) rounds for several ranks in one process."""
    infos = [info(name, m.shape, step, r) for r, m in enumerate(mats)]
    outs = [c.compress(m, i) for c, m, i in zip(comps, mats, infos)]
    payloads, ctxs = [o[0] for o in outs], [o[1] for o in outs]
    while True:
        avg = torch.stack(payloads).mean(0)
        res = [c.decompress(avg.clone(), ctx, i) for c, ctx, i in zip(comps, ctxs, infos)]
        if not isinstance(res[0], Continue):
            return res, payloads, ctxs, infos
        payloads, ctxs = [r.payload for r in res], [r.ctx for r in res]


def test_powersgd_exact_for_low_rank_two_ranks():
    g = torch.Generator().manual_seed(4)
    A = torch.randn(40, 3, generator=g) @ torch.randn(3, 6, 5, generator=g).reshape(3, 30)
    A = A.reshape(40, 6, 5)  # 3-D tensor viewed as 40 x 30
    D = torch.randn(40, 6, 5, generator=g)
    comps = [C("powersgd:rank=3,start_step=0"), C("powersgd:rank=3,start_step=0")]
    for step in range(2):  # first step and warm-started step
        res, payloads, _, _ = powersgd_round(comps, [A + D, A - D], step=step)
        assert payloads[0].numel() == 30 * 3  # second round: m x r
        for r in res:
            assert r.shape == A.shape and torch.allclose(r, A, atol=1e-4), float((r - A).abs().max())
    assert torch.equal(comps[0].q_memory["m"], comps[1].q_memory["m"])
    assert comps[0].wire_bytes_for((40, 6, 5)) == 4 * (40 + 30) * 3


def test_powersgd_feedback_conserves_and_resumes():
    g = torch.Generator().manual_seed(5)
    comp = C("powersgd:rank=1,start_step=0")
    fb = comp.feedback
    total_in, total_applied = torch.zeros(30, 20), torch.zeros(30, 20)
    for step in range(4):
        grad = torch.randn(30, 20, generator=g)
        i = info("m", grad.shape, step)
        u = fb.compensate("m", grad, i)
        res, _, _, _ = powersgd_round([comp], [u], step=step)
        p, ctx = comp.compress(u, i)  # fresh ctx only to call local_contribution
        sent = comp.local_contribution(p, ("P",), i, res[0])
        assert torch.equal(sent, res[0])
        fb.update("m", u, sent, i)
        fb.commit()
        total_in += grad
        total_applied += res[0]
        if step == 1:
            state, fstate = comp.state_dict(), fb.state_dict()
    assert torch.allclose(total_applied + fb.memory["m"], total_in, atol=1e-4)
    assert float(fb.memory["m"].norm()) > 0.1  # really compressed (rank 1 of 30x20)
    # resume from the step-1 checkpoint: steps 2..3 give identical results
    g2 = torch.Generator().manual_seed(5)
    grads = [torch.randn(30, 20, generator=g2) for _ in range(4)]
    comp2 = C("powersgd:rank=1,start_step=0")
    comp2.load_state_dict(state)
    comp2.feedback.load_state_dict(fstate)
    for step in (2, 3):
        i = info("m", (30, 20), step)
        u = comp2.feedback.compensate("m", grads[step], i)
        res, _, _, _ = powersgd_round([comp2], [u], step=step)
        comp2.feedback.update("m", u, res[0], i)
        comp2.feedback.commit()
    assert torch.equal(comp2.q_memory["m"], comp.q_memory["m"])
    assert torch.equal(comp2.feedback.memory["m"], fb.memory["m"])


def test_powersgd_sends_vectors_and_tiny_dense():
    comp = C("powersgd:rank=4")
    for shape in ((50,), (3, 3), (2, 100)):
        x = torch.randn(*shape)
        i = info("t", shape)
        p, ctx = comp.compress(x, i)
        assert ctx[0] == "dense" and torch.equal(p, x.reshape(-1))
        assert torch.equal(comp.decompress(p, ctx, i), x)
        assert comp.wire_bytes_for(shape) == 4 * x.numel()
    late = C("powersgd:rank=1,start_step=3")
    assert late.compress(torch.randn(20, 20), info("t", (20, 20), step=2))[1][0] == "dense"
    assert late.compress(torch.randn(20, 20), info("t", (20, 20), step=3))[1][0] == "P"


# ---- bad arguments -------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [
    "qsgd:bits=1", "qsgd:bits=9", "qsgd:levels=200", "qsgd:bits=3,levels=7", "qsgd:norm=l3", "qsgd:bucket=-1",
    "terngrad:clip=-1", "signum:beta=1", "signum:beta=x", "int8:chunk=-2", "int8:stochastic=maybe",
    "natural:seed=-1", "powersgd:rank=0", "powersgd:min_compression=0.5", "powersgd:rank=1.5",
    "qdist:bits=0", "qdist:bits=9", "qdist:dist=cauchy", "qdist:budget=0.5", "qdist:budget=9",
    "qdist:bits=3,budget=3", "signsgd:bits=1", "onebit:foo=1", "efsignsgd:feedback=nope",
])
def test_bad_arguments(spec):
    with pytest.raises(ValueError):
        C(spec)


# ---- 2 ranks through Horovod ---------------------------------------------------------------

def test_two_ranks_vote_powersgd_qdist(run_ranks):
    res = run_ranks("sign_vote.py", np=2)
    for r in res:
        assert r["vote"] == [1.0, 0.0, 0.0, -1.0, 1.0, 0.0, 0.0, 0.0]
        assert r["vote_bytes"] == 13  # exchange header 12 + 1 byte of signs (a frame's last payload is not padded)
        assert r["psgd_err"] < 1e-4 and r["psgd_vec_err"] == 0.0 and r["psgd_agree"] and r["psgd_has_q"]
        assert r["psgd_mem_sum"] < 1e-4
        assert r["qdist_agree"] == [True, True] and r["qdist_params_agree"]
        assert set(r["qdist_bits"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
