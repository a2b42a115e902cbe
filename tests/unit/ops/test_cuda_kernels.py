"""hvd_ext.ops.cuda_kernels: nvcc compile checks, torch reference tests (CPU), kernel == reference.

"kernel == reference" tests run on every device of ``kdev`` (tests/conftest.py): a real GPU
(skipped without one, with the reason), and the CPU harness -- the same kernels/*.cu sources
executed on CPU threads (tests/cuda_cpu), launched by hvd_ext.ops.cuda_kernels' own host code on
tensors of an emulated GPU -- at sizes the harness runs in seconds. nvcc tests need ``nvcc``.
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from hvd_ext.ops import cuda_kernels as K
from hvd_ext.ops.hashing import mix32_int

from conftest import ROOT
KDIR = ROOT / "kernels"
CU_FILES = sorted(p.name for p in KDIR.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")


@pytest.fixture(autouse=True)
def _auto_dispatch():
    K.use_reference(False)
    yield
    K.use_reference(False)


# ---------------------------------------------------------------------------------------------
# nvcc compile checks (each file compiled once per arch, one nvcc call per file)
# ---------------------------------------------------------------------------------------------

NVCC = shutil.which("nvcc")


@pytest.fixture(scope="session")
def nvcc_outdir():
    d = tempfile.mkdtemp(prefix="hvd_ext_nvcc_")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_kernel_files_present():
    assert set(K.KERNEL_FILES) <= set(CU_FILES), CU_FILES
    assert (KDIR / "common.cuh").is_file()


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: CUDA compile check not run")
@pytest.mark.parametrize("name", CU_FILES)
def test_nvcc_compiles(name, nvcc_outdir):
    out = nvcc_outdir / (name + ".fatbin")
    gencode = []
    for a in ARCHS:
        gencode += ["-gencode", f"arch=compute_{a[3:]},code={a}"]
    cmd = [NVCC, "-fatbin", "-std=c++14", "-I", str(KDIR), *gencode, "-o", str(out), str(KDIR / name)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    blob = out.read_bytes()
    src = (KDIR / name).read_text()
    for entry in re.findall(r'extern "C" __global__ void (\w+)', src):
        assert entry.encode() in blob, f"{entry} missing from {out}"


def test_sources_are_nvrtc_friendly_and_entry_points_exist():
    """NVRTC has no standard headers: the only include is common.cuh (inlined by kernel_source);
    every kernel name hvd_ext/ops/cuda_kernels.py launches exists as an extern "C" entry point."""
    defined = set()
    for name in K.KERNEL_FILES:
        src = K.kernel_source(name)
        assert "#include" not in src, name
        defined |= set(re.findall(r'extern "C" __global__ void (\w+)', src))
    used = set(re.findall(r'"(hvd_\w+)"', (ROOT / "hvd_ext" / "ops" / "cuda_kernels.py").read_text()))
    assert used and used <= defined, used - defined


def test_kernel_dir_env_override(tmp_path, monkeypatch):
    for f in list(K.KERNEL_FILES) + ["common.cuh"]:
        shutil.copy(KDIR / f, tmp_path / f)
    monkeypatch.setenv("HVD_EXT_KERNEL_DIR", str(tmp_path))
    assert K.kernel_dir() == tmp_path
    monkeypatch.delenv("HVD_EXT_KERNEL_DIR")
    assert K.kernel_dir() in (KDIR.resolve(), (ROOT / "hvd_ext" / "_cu").resolve())


def test_dispatch_switches(monkeypatch):
    x = torch.zeros(4)
    assert K.backend(x) == "reference"
    K.use_reference(True)
    assert K.backend(x) == "reference"
    # the environment switch is read at import: load a fresh copy of the module with it set
    import importlib.util
    monkeypatch.setenv("HVD_EXT_KERNELS", "reference")
    spec = importlib.util.spec_from_file_location("_hvd_ext_kernels_copy", ROOT / "hvd_ext" / "ops" / "cuda_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod._force_reference is True
    assert mod.backend(torch.zeros(1)) == "reference"


def test_check_args_refuses_what_a_kernel_would_misread():
    """Every launch is checked against the kernel's C signature before it runs: a wrong count, a
    value where a pointer goes, a wrong element type, or memory on another device is refused."""
    import numpy as np
    sig = K.kernel_signatures()
    assert set(sig) >= {"hvd_pack_bits", "hvd_scatter_add", "hvd_hist_abs"}
    x, out = torch.zeros(16, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8)
    dev = x.device
    K._check_args("hvd_pack_bits", dev, (x, np.int64(16), np.int32(3), out, np.int64(6)))
    with pytest.raises(TypeError, match="arguments"):
        K._check_args("hvd_pack_bits", dev, (x, np.int64(16), np.int32(3), out))
    with pytest.raises(TypeError, match="numpy int32"):
        K._check_args("hvd_pack_bits", dev, (x, np.int64(16), 3, out, np.int64(6)))
    with pytest.raises(ValueError, match="dtype"):
        K._check_args("hvd_pack_bits", dev, (x.float(), np.int64(16), np.int32(3), out, np.int64(6)))
    with pytest.raises(ValueError, match="on meta"):
        K._check_args("hvd_pack_bits", dev, (x.to("meta"), np.int64(16), np.int32(3), out, np.int64(6)))
    with pytest.raises(ValueError, match="is on"):  # the pointer tables of the multi-rank kernels too
        K._ptrs([x, x.to("meta")], dev, (torch.uint8,), "majority_vote")
    with pytest.raises(ValueError, match="dtype"):
        K._ptrs([x, x.int()], dev, (torch.uint8,), "majority_vote")


# ---------------------------------------------------------------------------------------------
# counter-based random numbers
# ---------------------------------------------------------------------------------------------

def _py_hash(key, i):
    lo, hi = i & 0xFFFFFFFF, i >> 32
    k = key if hi == 0 else mix32_int(key ^ ((hi * 0x9E3779B9) & 0xFFFFFFFF))
    return mix32_int(lo ^ k)


def test_hash_tensor_matches_python_ints():
    key = K.stream_key(12345, 77)
    idx = [0, 1, 2, 1000, 2 ** 31 - 1, 2 ** 32 - 1, 2 ** 32, 2 ** 40 + 12345]
    got = K.hash_u32(key, torch.tensor(idx, dtype=torch.int64)).tolist()
    assert got == [_py_hash(key, i) for i in idx]
    assert K.hash_u32(key, torch.tensor(idx[:5])).tolist() == [_py_hash(key, i) for i in idx[:5]]
    u = K.uniform(key, torch.arange(200_000))
    assert u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert K.stream_key(1, 2) != K.stream_key(2, 1)


# ---------------------------------------------------------------------------------------------
# bit packing (reference, CPU)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 8, 9, 1003):
        codes = torch.randint(0, 2 ** bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
        data = K.pack_bits(codes, bits)
        assert data.dtype == torch.uint8 and data.numel() == math.ceil(n * bits / 8)
        assert torch.equal(K.unpack_bits(data, bits, n), codes)
        if n % 8 and bits < 8:   # unused high bits of the last byte are zero
            used = (n * bits) % 8
            assert int(data[-1]) >> used == 0


def test_bit_order_hand_examples():
    # bits=3, codes 1,2,7,0,5 -> stream bits (LSB first) 100 010 111 000 101 -> 0xD1, 0x51
    assert K.pack_bits(torch.tensor([1, 2, 7, 0, 5], dtype=torch.uint8), 3).tolist() == [0xD1, 0x51]
    assert K.pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0x81, 0x01]
    assert K.pack_bits(torch.tensor([0xA, 0x3], dtype=torch.uint8), 4).tolist() == [0x3A]
    assert K.pack_bits(torch.tensor([0x7F, 0x01], dtype=torch.uint8), 7).tolist() == [0xFF, 0x00]
    with pytest.raises(ValueError):
        K.pack_bits(torch.zeros(3, dtype=torch.uint8), 9)
    with pytest.raises(ValueError):
        K.unpack_bits(torch.zeros(1, dtype=torch.uint8), 3, 5)


def test_same_contract_as_compression_bitpack():
    bp = pytest.importorskip("hvd_ext.ops.bits", reason="hvd_ext/ops/bits.py not there yet")
    g = torch.Generator().manual_seed(0)
    for bits in range(1, 9):
        codes = torch.randint(0, 2 ** bits, (1001,), generator=g).to(torch.uint8)
        assert torch.equal(K.pack_bits(codes, bits), bp.pack_bits(codes, bits))
        assert torch.equal(bp.unpack_bits(K.pack_bits(codes, bits), bits, 1001), codes)


# ---------------------------------------------------------------------------------------------
# threshold selection (reference, CPU)
# ---------------------------------------------------------------------------------------------

def _check_selection(x, idx, val, k, lo=0.5, hi=2.0):
    assert idx.dtype == torch.int32
    assert lo * k <= idx.numel() <= hi * k, (idx.numel(), k)
    if idx.numel() > 1:
        assert bool((idx[1:] > idx[:-1]).all()), "indices not strictly ascending"
    assert torch.equal(val, x[idx.long()])
    mask = torch.ones(x.numel(), dtype=torch.bool)
    mask[idx.long()] = False
    if mask.any() and idx.numel():
        assert float(x.abs()[~mask].min()) >= float(x.abs()[mask].max())   # a threshold set


def test_select_threshold_histogram_count_near_k():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g)
    for k in (1, 20, 2000, 20_000):
        idx, val = K.select_threshold(x, k)
        _check_selection(x, idx, val, k, lo=0.95, hi=1.05)  # 24 bits of histogram: k, give or take a bin
    # heavy tails / layer-like mixture
    y = torch.cat([torch.randn(50_000, generator=g) * 1e-4, torch.randn(150_000, generator=g) ** 3])
    idx, val = K.select_threshold(y, 2000)
    _check_selection(y, idx, val, 2000, lo=0.95, hi=1.05)


def test_select_threshold_exact_equals_brute_force():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50_000, generator=g)
    for k in (1, 17, 500, 49_999):
        idx, val = K.select_threshold(x, k, exact=True)
        ref = torch.topk(x.abs(), k).indices.sort().values
        assert torch.equal(idx.long(), ref)
        assert torch.equal(val, x[ref])


def test_select_threshold_histogram_levels():
    # 1. spikes among zeros: level 1 separates them exactly
    x = torch.zeros(300_000)
    spikes = torch.tensor([3, 99_999, 150_000, 200_001, 299_999])
    x[spikes] = torch.tensor([5.0, -7.0, 2.0, -3.0, 11.0])
    idx, val = K.select_threshold(x, 5)
    assert torch.equal(idx.long(), spikes)
    # 2. every |x| in one level-1 bin ([1, 1.0625)): level 2 inside it finds the count
    g = torch.Generator().manual_seed(3)
    y = (1.0 + torch.randperm(100_000, generator=g).float() * 2 ** -21) * torch.where(
        torch.rand(100_000, generator=g) < 0.5, -1.0, 1.0)
    t, c = K._hist_threshold(y, 1000, K._RefOps())
    assert 950 <= int(c) <= 1050 and int(c) == int((y.abs() >= t).sum())
    idx, val = K.select_threshold(y, 1000)
    _check_selection(y, idx, val, 1000)
    # the two steps a caller batching several selections makes (threshold_for, then compact_ge)
    t2, c2 = K.threshold_for(y, 1000)
    i2, v2 = K.compact_ge(y, t2, int(c2))
    assert torch.equal(i2, idx) and torch.equal(v2, val)


def test_select_threshold_edge_cases():
    x = torch.randn(1000)
    idx, val = K.select_threshold(x, 0)
    assert idx.numel() == 0 and idx.dtype == torch.int32
    idx, val = K.select_threshold(x, 5000)
    assert torch.equal(idx.long(), torch.arange(1000)) and torch.equal(val, x)
    idx, val = K.select_threshold(torch.empty(0), 3)
    assert idx.numel() == 0
    # ties: all equal -> cannot get within 2x; must not crash, returns a threshold set
    idx, val = K.select_threshold(torch.ones(10_000), 10)
    assert idx.numel() in (0, 10_000) or idx.numel() >= 5
    # NaN is never selected
    z = torch.randn(10_000)
    z[7] = float("nan")
    for exact in (True, False):
        idx, _ = K.select_threshold(z, 100, exact=exact)
        assert 7 not in idx.tolist() and idx.numel() >= 100
    with pytest.raises(ValueError):
        K.select_threshold(x, -1)
    with pytest.raises(ValueError):
        K.threshold_for(x, 1000)  # k must be below numel


# ---------------------------------------------------------------------------------------------
# quantize / dequantize (reference, CPU)
# ---------------------------------------------------------------------------------------------

def _dequant(data, levels, scale, bits, n):
    out = torch.zeros(n)
    return K.unpack_dequantize_accumulate(out, [data], levels, [scale], bits, n)


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_quantize_unbiased(bits):
    L = 2 ** bits
    levels = torch.linspace(-1, 1, L)
    g = torch.Generator().manual_seed(bits)
    n, T, scale = 512, 400, 2.5
    x = (torch.rand(n, generator=g) * 2 - 1) * scale
    # T independent draws per element in one call: x repeated T times (different element indices)
    xr = x.repeat(T)
    est = _dequant(K.quantize_pack(xr, levels, scale, bits, seed=9, step=1), levels, scale, bits, n * T)
    est = est.view(T, n).mean(0)
    gap = 2.0 / (L - 1) * scale
    # per element: variance <= gap^2/4 per draw; 5 sigma
    assert float((est - x).abs().max()) < 5 * (gap / 2) / math.sqrt(T) + 1e-6
    # overall bias: mean of n*T independent draws
    assert abs(float((est - x).mean())) < 5 * (gap / 2) / math.sqrt(n * T)


def test_quantize_deterministic_cases_and_reproducible():
    levels = torch.tensor([-1.0, -0.25, 0.0, 0.5, 1.0])
    bits = 3
    x = torch.tensor([-1.0, -0.25, 0.0, 0.5, 1.0, -3.0, 7.0, float("nan")])
    codes = K.unpack_bits(K.quantize_pack(x, levels, 1.0, bits, seed=1, step=2), bits, x.numel())
    assert codes.tolist() == [0, 1, 2, 3, 4, 0, 4, 0]
    y = torch.randn(10_001)
    a = K.quantize_pack(y, levels, 2.0, bits, seed=4, step=7)
    assert torch.equal(a, K.quantize_pack(y, levels, 2.0, bits, seed=4, step=7))
    assert not torch.equal(a, K.quantize_pack(y, levels, 2.0, bits, seed=4, step=8))
    assert not torch.equal(a, K.quantize_pack(y, levels, 2.0, bits, seed=5, step=7))
    assert a.numel() == math.ceil(10_001 * bits / 8)
    # neighbours only: the dequantized value brackets x/scale
    d = _dequant(a, levels, 1.0, bits, y.numel())
    v = (y / 2.0).clamp(-1, 1)
    lv = levels.tolist()
    for vi, di in zip(v[:300].tolist(), d[:300].tolist()):
        lo = max(l for l in lv if l <= vi + 1e-7)
        hi = min(l for l in lv if l >= vi - 1e-7)
        assert di in (lo, hi)
    with pytest.raises(ValueError):
        K.quantize_pack(y, torch.linspace(-1, 1, 9), 1.0, 3)
    with pytest.raises(ValueError):
        K.quantize_pack(y, levels, -1.0, 3)


def test_unpack_dequantize_accumulate_sums_ranks():
    g = torch.Generator().manual_seed(4)
    n, bits, N = 1001, 3, 4
    levels = [torch.sort(torch.randn(8, generator=g)).values for _ in range(N)]
    scales = [0.5, 1.0, 2.0, 3.0]
    codes = [torch.randint(0, 8, (n,), generator=g).to(torch.uint8) for _ in range(N)]
    datas = [K.pack_bits(c, bits) for c in codes]
    out = torch.full((n,), 1.5)
    K.unpack_dequantize_accumulate(out, datas, levels, scales, bits, n)
    exp = torch.full((n,), 1.5)
    for c, l, s in zip(codes, levels, scales):
        exp += l[c.long()] * s
    assert torch.allclose(out, exp, atol=1e-5)
    # shared levels tensor, scales tensor
    out2 = torch.zeros(n)
    K.unpack_dequantize_accumulate(out2, datas, levels[0], torch.tensor(scales), bits, n)
    exp2 = sum(levels[0][c.long()] * s for c, s in zip(codes, scales))
    assert torch.allclose(out2, exp2, atol=1e-5)
    with pytest.raises(ValueError):
        K.unpack_dequantize_accumulate(torch.zeros(n + 1), datas, levels, scales, bits, n)


# ---------------------------------------------------------------------------------------------
# sign / majority vote, scatter-add, memory updates (reference, CPU)
# ---------------------------------------------------------------------------------------------

def test_sign_pack_and_majority_vote():
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, float("nan"), -1e-30, 3.0, -4.0, 5.0])
    assert K.sign_pack(x).tolist() == [0b01001101, 0b1]
    g = torch.Generator().manual_seed(5)
    n = 1003
    for N in (1, 2, 3, 4, 7):
        xs = [torch.randn(n, generator=g) for _ in range(N)]
        datas = [K.sign_pack(t) for t in xs]
        assert all(d.numel() == (n + 7) // 8 for d in datas)
        mv = K.majority_vote(datas, n)
        s = sum(torch.where(t >= 0, 1, -1) for t in xs)
        exp = torch.where(s >= 0, 1.0, -1.0)            # tie -> +1
        assert mv.dtype == torch.float32 and torch.equal(mv, exp)


def test_sparse_scatter_add_equals_dense_sum():
    g = torch.Generator().manual_seed(6)
    n, N = 5000, 4
    dense = torch.zeros(n)
    idxs, vals = [], []
    for r in range(N):
        k = [300, 0, 1, 999][r]
        i = torch.randperm(n, generator=g)[:k].sort().values
        v = torch.randn(k, generator=g)
        dense[i] += v
        idxs.append(i.to(torch.int32) if r % 2 else i)
        vals.append(v)
    out = torch.zeros(n)
    K.sparse_scatter_add(out, idxs, vals, scale=1.0)
    assert torch.allclose(out, dense, atol=1e-6)
    out = torch.ones(n)
    K.sparse_scatter_add(out, idxs, vals, scale=0.25)
    assert torch.allclose(out, 1 + dense * 0.25, atol=1e-6)
    with pytest.raises(ValueError):
        K.sparse_scatter_add(out, idxs[:1], vals[:1] + vals[:1])


def test_residual_and_ewma_updates():
    g = torch.Generator().manual_seed(7)
    u, sent = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    mem = torch.empty(1000)
    assert K.residual_update(mem, u, sent) is mem
    assert torch.equal(mem, u - sent)
    S, G = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    mask = torch.rand(1000, generator=g) < 0.3
    S0 = S.clone()
    K.ewma_update(S, G, mask, 0.9)
    exp = torch.where(mask, 0.9 * S0 + 0.1 * G, S0)
    assert torch.allclose(S, exp, atol=1e-6)
    assert torch.equal(S[~mask], S0[~mask])
    K.ewma_update(S, G, None, 0.0)
    assert torch.equal(S, G)
    with pytest.raises(ValueError):
        K.ewma_update(S, G, mask, 1.5)


# ---------------------------------------------------------------------------------------------
# kernel == reference, on every device of ``kdev`` (a real GPU; the CPU harness)
# ---------------------------------------------------------------------------------------------

def _ref(fn, *args, **kw):
    K.use_reference(True)
    try:
        return fn(*args, **kw)
    finally:
        K.use_reference(False)


def test_kernel_backend_selected(kdev):
    assert K.backend(kdev.put(torch.zeros(1))) == "cuda"
    assert K.backend(torch.zeros(1)) == "reference"


@pytest.mark.parametrize("bits", range(1, 9))
def test_kernel_pack_unpack_bit_exact(kdev, bits):
    g = torch.Generator().manual_seed(bits)
    for n in sorted({kdev.n(x) for x in (1, 7, 8, 9, 4097, 1_000_003)}):
        codes = torch.randint(0, 2 ** bits, (n,), generator=g).to(torch.uint8)
        ref = _ref(K.pack_bits, codes, bits)
        got = K.pack_bits(kdev.put(codes), bits)
        assert torch.equal(kdev.get(got), ref)
        buf = torch.zeros(ref.numel() + 1, dtype=torch.uint8)
        buf[1:] = ref                                          # misaligned view
        assert torch.equal(kdev.get(K.unpack_bits(kdev.put(buf)[1:], bits, n)), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_kernel_quantize_pack_bit_exact(kdev, bits):
    g = torch.Generator().manual_seed(10 + bits)
    levels = torch.sort(torch.randn(2 ** bits, generator=g)).values
    for n in (1, 13, kdev.n(100_003)):
        x = torch.randn(n + 1, generator=g) * 3
        x[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])[: min(3, n + 1)]
        for xs in (x[:n], x[1:]):                              # aligned and misaligned
            ref = _ref(K.quantize_pack, xs, levels, 1.7, bits, 3, 11)
            got = K.quantize_pack(kdev.put(x)[:n] if xs.data_ptr() == x.data_ptr() else kdev.put(x)[1:],
                                  kdev.put(levels), 1.7, bits, 3, 11)
            assert torch.equal(kdev.get(got), ref)


def test_kernel_quantize_unbiased(kdev):
    bits, T, n, scale = 2, 200, kdev.n(4096) // 4, 1.0
    levels = torch.linspace(-1, 1, 4)
    x = torch.rand(n, generator=torch.Generator().manual_seed(3)) * 2 - 1
    est = kdev.put(torch.zeros(n))
    for step in range(T):
        d = K.quantize_pack(kdev.put(x), kdev.put(levels), scale, bits, seed=1, step=step)
        K.unpack_dequantize_accumulate(est, [d], kdev.put(levels), [scale], bits, n)
    est = kdev.get(est) / T
    gap = 2 / 3
    assert float((est - x).abs().max()) < 5 * (gap / 2) / math.sqrt(T)
    assert abs(float((est - x).mean())) < 5 * (gap / 2) / math.sqrt(n * T)


@pytest.mark.parametrize("N,L", [(3, 8), (40, 256)])        # shared-memory table / global table
def test_kernel_unpack_dequantize_accumulate_bit_exact(kdev, N, L):
    bits = int(math.log2(L))
    n = kdev.n(100_001)
    g = torch.Generator().manual_seed(N)
    levels = [torch.sort(torch.randn(L, generator=g)).values for _ in range(N)]
    scales = (torch.rand(N, generator=g) + 0.5).tolist()
    datas = [K.pack_bits(torch.randint(0, L, (n,), generator=g).to(torch.uint8), bits) for _ in range(N)]
    init = torch.randn(n, generator=g)
    ref = _ref(K.unpack_dequantize_accumulate, init.clone(), datas, levels, scales, bits, n)
    got = K.unpack_dequantize_accumulate(kdev.put(init), [kdev.put(d) for d in datas],
                                         [kdev.put(lv) for lv in levels], scales, bits, n)
    assert torch.equal(kdev.get(got), ref)


def test_kernel_select_threshold_same_as_reference(kdev):
    g = torch.Generator().manual_seed(20)
    n1, n2 = kdev.n(1_000_003), kdev.n(5_000_000)
    cases = [
        (torch.randn(n1, generator=g), max(1, n1 // 100), False),
        (torch.randn(n2, generator=g) ** 3, max(1, n2 // 100), False),
        (torch.randn(kdev.n(100_000), generator=g), 777, True),                      # exact
    ]
    z = torch.zeros(kdev.n(2_000_000))
    z[torch.randperm(z.numel(), generator=g)[:50]] = torch.randn(50, generator=g)
    cases.append((z, 50, False))                                                   # level 1 separates
    y = (1.0 + torch.randperm(kdev.n(300_000), generator=g).float() * 2 ** -21)
    cases.append((y, 1000, False))                                                 # level 2 needed
    for x, k, exact in cases:
        ri, rv = _ref(K.select_threshold, x, k, exact)
        gi, gv = K.select_threshold(kdev.put(x), k, exact)
        assert torch.equal(kdev.get(gi), ri) and torch.equal(kdev.get(gv), rv)
        _check_selection(x, ri, rv, k)


def test_kernel_sign_majority_bit_exact(kdev):
    g = torch.Generator().manual_seed(21)
    for n in (1, 31, 33, kdev.n(1_000_001)):
        xs = [torch.randn(n, generator=g) for _ in range(5)]
        xs[0][: min(n, 3)] = torch.tensor([0.0, -0.0, float("nan")])[: min(n, 3)]
        refs = [_ref(K.sign_pack, x) for x in xs]
        gots = [K.sign_pack(kdev.put(x)) for x in xs]
        for r, t in zip(refs, gots):
            assert torch.equal(kdev.get(t), r)
        for N in (2, 5):
            assert torch.equal(kdev.get(K.majority_vote(gots[:N], n)), _ref(K.majority_vote, refs[:N], n))


def test_kernel_scatter_add_matches(kdev):
    g = torch.Generator().manual_seed(22)
    n = kdev.n(1_000_000)
    idxs = [torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32) for k in (n // 100, 0, 5, n // 50)]
    vals = [torch.randn(i.numel(), generator=g) for i in idxs]
    ref = _ref(K.sparse_scatter_add, torch.zeros(n), idxs, vals, 0.25)
    for cast in (lambda i: i, lambda i: i.long()):
        got = K.sparse_scatter_add(kdev.put(torch.zeros(n)), [kdev.put(cast(i)) for i in idxs],
                                   [kdev.put(v) for v in vals], 0.25)
        assert torch.allclose(kdev.get(got), ref, atol=1e-6)


def test_kernel_scatter_add_refuses_indices_out_of_range(kdev):
    """A corrupt payload must not write outside the buffer: the kernel skips the entry and counts it,
    and the host raises (at once outside a pipeline step) as the torch path does."""
    out = kdev.put(torch.zeros(100))
    for bad in ([3, 100], [-1, 5]):
        with pytest.raises(ValueError, match="outside"):
            K.sparse_scatter_add(out, [kdev.put(torch.tensor(bad, dtype=torch.int32))], [kdev.put(torch.ones(2))])
    with pytest.raises(ValueError, match="outside"):
        _ref(K.sparse_scatter_add, torch.zeros(100), [torch.tensor([100])], [torch.ones(1)])
    assert float(kdev.get(out).abs().sum()) <= 2.0  # only the in-range entries were added


def test_kernel_memory_updates_bit_exact(kdev):
    g = torch.Generator().manual_seed(23)
    n = kdev.n(1_000_003)
    u, sent, S, G = (torch.randn(n, generator=g) for _ in range(4))
    mask = torch.rand(n, generator=g) < 0.1
    mem = kdev.put(torch.empty(n))
    K.residual_update(mem, kdev.put(u), kdev.put(sent))
    Sg = kdev.put(S.clone())
    K.ewma_update(Sg, kdev.put(G), kdev.put(mask), 0.9)
    assert torch.equal(kdev.get(mem), _ref(K.residual_update, torch.empty(n), u, sent))
    assert torch.equal(kdev.get(Sg), _ref(K.ewma_update, S.clone(), G, mask, 0.9))
    S2 = kdev.put(S.clone())
    K.ewma_update(S2, kdev.put(G), None, 0.3)
    assert torch.equal(kdev.get(S2), _ref(K.ewma_update, S.clone(), G, None, 0.3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the side-stream test needs real streams")
def test_gpu_memory_updates_on_side_stream():
    n = 1_000_003
    g = torch.Generator().manual_seed(24)
    u, sent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        mem = torch.empty(n, device="cuda")
        K.residual_update(mem, u.cuda(), sent.cuda())
    s.synchronize()
    assert torch.equal(mem.cpu(), u - sent)


def test_every_kernel_runs_on_the_harness(kdev):
    """Every entry point of kernels/*.cu is reached by the public functions (the CPU harness counts
    its launches)."""
    if kdev.name != "cpu-harness":
        pytest.skip("counts launches of the CPU harness")
    g = torch.Generator().manual_seed(25)
    x = torch.randn(5000, generator=g)
    d = kdev.put
    K.unpack_bits(K.pack_bits(d(torch.randint(0, 8, (100,), generator=g).to(torch.uint8)), 3), 3, 100)
    q = K.quantize_pack(d(x), d(torch.linspace(-1, 1, 8)), 2.0, 3, 1, 2)
    K.unpack_dequantize_accumulate(d(torch.zeros(5000)), [q, q], d(torch.linspace(-1, 1, 8)), [1.0, 2.0], 3, 5000)
    sp = K.sign_pack(d(x))
    K.majority_vote([sp, sp, sp], 5000)
    K.residual_update(d(torch.zeros(5000)), d(x), d(x))
    K.ewma_update(d(torch.zeros(5000)), d(x), d(x > 0), 0.9)
    K.sparse_scatter_add(d(torch.zeros(5000)), [d(torch.arange(5, dtype=torch.int32))], [d(torch.ones(5))], 0.5)
    K.select_threshold(d(x), 50)
    rt = K._runtime
    assert set(rt.launches) == set(K.kernel_signatures()) == set(rt.kernels()), \
        set(K.kernel_signatures()) - set(rt.launches)


# ---------------------------------------------------------------------------------------------
# failing safe: no usable CuPy, a kernel that fails to compile or launch
# ---------------------------------------------------------------------------------------------

class _BrokenRuntime:
    """A runtime whose launches fail as NVRTC or the driver would."""
    name = "broken"

    def __init__(self, why=None):
        self.why, self.calls = why, 0

    def unavailable(self):
        return self.why

    def accepts(self, t):
        return t.is_cuda

    def sm_count(self, device):
        return 4

    def launch(self, device, module, fn, grid, block, args, shared_mem):
        self.calls += 1
        raise RuntimeError("nvrtc: error: invalid value for --gpu-architecture")


def test_kernel_failure_warns_once_then_torch_path(recwarn):
    from hvd_ext.testing.device import EmulatedDevice, to_device, to_host
    prev = K.use_runtime(_BrokenRuntime())
    try:
        with EmulatedDevice():
            x = torch.randn(1000)
            with pytest.warns(RuntimeWarning, match=r"hvd_sign_pack failed .*nvrtc"):
                got = K.sign_pack(to_device(x))
            assert torch.equal(to_host(got), _ref(K.sign_pack, x))        # the torch path's answer
            assert K.backend(to_device(x)) == "reference"                  # off for the rest of the run
            codes = torch.randint(0, 4, (100,)).to(torch.uint8)
            assert torch.equal(to_host(K.pack_bits(to_device(codes), 2)), _ref(K.pack_bits, codes, 2))
            assert K._runtime.calls == 1
        assert not [w for w in recwarn if "failed" in str(w.message)]    # once
    finally:
        K.use_runtime(prev)


def test_device_tensors_without_cupy_warn_once():
    from hvd_ext.testing.device import EmulatedDevice, to_device, to_host
    prev = K.use_runtime(_BrokenRuntime("ImportError: No module named 'cupy'"))
    try:
        with EmulatedDevice():
            x = to_device(torch.randn(100))
            with pytest.warns(RuntimeWarning, match="cannot run .*No module named 'cupy'.*cupy-cuda12x"):
                assert K.backend(x) == "reference"
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert K.backend(x) == "reference"                          # said once
            assert torch.equal(to_host(K.sign_pack(x)), _ref(K.sign_pack, to_host(x)))
            assert K._runtime.calls == 0
    finally:
        K.use_runtime(prev)


def test_cupy_runtime_reports_why_it_is_unavailable(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_cupy(name, *a, **k):
        if name == "cupy":
            raise ImportError("no cupy here")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    rt = K.CupyRuntime()
    assert "no cupy here" in rt.unavailable()
    assert not rt.accepts(torch.zeros(1))


def test_levels_must_be_sorted(kdev):
    x = torch.randn(100)
    with pytest.raises(ValueError, match="sorted"):
        K.quantize_pack(x, torch.tensor([0.0, -1.0, 1.0, 2.0]), 1.0, 2)
    with pytest.raises(ValueError, match="sorted"):
        K.quantize_pack(kdev.put(x), kdev.put(torch.tensor([0.0, -1.0, 1.0, 2.0])), 1.0, 2)


# ---------------------------------------------------------------------------------------------
# the sanitizers, and bugs seeded into the kernels (the harness must catch them)
# ---------------------------------------------------------------------------------------------

def _run_child(variant, *pytest_args, sources_dir=None, timeout=900, cap=None):
    """Run this module's harness tests in a child process on a ``variant`` build (a sanitizer's runtime
    preloaded), at sizes up to ``cap``."""
    from cuda_cpu import harness
    if harness.available() is not None:
        pytest.skip(harness.available())
    env = harness.sanitizer_env(variant)
    env["HVD_CUDA_CPU_VARIANT"] = variant
    if cap is not None:
        env["HVD_CUDA_CPU_CAP"] = str(cap)
    env["PYTHONPATH"] = str(ROOT) + ":" + str(ROOT / "tests")
    if sources_dir is not None:
        env["HVD_EXT_KERNEL_DIR"] = str(sources_dir)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-s", "-p", "no:cacheprovider", str(Path(__file__)),
           "-k", "cpu-harness", *pytest_args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(ROOT))


def test_kernels_clean_under_address_and_undefined_behaviour_sanitizers():
    """Every harness test again on a build with ASan + UBSan: an out-of-bounds access, a misaligned
    load or an overflow in any kernel fails the run."""
    proc = _run_child("asan")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert " passed" in proc.stdout


def test_barrier_kernels_race_free_under_thread_sanitizer():
    """The kernels that share memory between threads (barriers, warp exchanges, atomics) on a
    ThreadSanitizer build at small n: a missing barrier is a reported race."""
    proc = _run_child("tsan", "-k", "select_threshold or sign_majority or unpack_dequantize or quantize_pack_bit",
                      cap=8192)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert " passed" in proc.stdout


SEEDED_BUGS = {
    # a removed barrier: lane 0 of each warp writes its count, every thread reads all of them
    "missing __syncthreads": ("sparsify.cu", "        if (lane == 0) warp_tot[warp] = __popc(b);\n        __syncthreads();",
                              "        if (lane == 0) warp_tot[warp] = __popc(b);", "tsan", "select_threshold"),
    # an off-by-one loop bound: the last rank's vote is left out
    "off-by-one bound": ("sign.cu", "for (int r = 0; r < nranks; ++r)", "for (int r = 0; r < nranks - 1; ++r)", "plain",
                         "sign_majority"),
    # a changed rounding: one fused multiply-add instead of two roundings
    "changed rounding": ("memory.cu", "__fadd_rn(__fmul_rn(b, S[i]), __fmul_rn(c, G[i]))",
                         "fmaf(b, S[i], __fmul_rn(c, G[i]))", "plain", "memory_updates"),
}


@pytest.mark.parametrize("bug", sorted(SEEDED_BUGS))
def test_seeded_bug_fails_the_kernel_tests(bug, tmp_path):
    """The tests have teeth: each bug seeded into a copy of kernels/*.cu makes them fail."""
    name, old, new, variant, k = SEEDED_BUGS[bug]
    for f in list(K.KERNEL_FILES) + ["common.cuh"]:
        shutil.copy(KDIR / f, tmp_path / f)
    src = (tmp_path / name).read_text()
    assert old in src, f"the seeded bug {bug!r} no longer applies to {name}"
    (tmp_path / name).write_text(src.replace(old, new))
    proc = _run_child(variant, "-k", k, sources_dir=tmp_path, cap=8192)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"seeded bug {bug!r} went unnoticed:\n{out[-3000:]}"
    caught = "ThreadSanitizer: data race" if variant == "tsan" else "AssertionError"  # not a build error
    assert caught in out, f"seeded bug {bug!r}: the run failed, but not by {caught}:\n{out[-3000:]}"
