"""hvd_ext.kernels: nvcc compile checks, torch reference tests (CPU), kernel == reference (GPU).

GPU tests need a CUDA device and CuPy; elsewhere they are skipped with the reason
(``pytest -rs`` prints it). nvcc tests need ``nvcc`` on PATH.
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hvd_ext import kernels as K

ROOT = Path(__file__).resolve().parents[1]
KDIR = ROOT / "kernels"
CU_FILES = sorted(p.name for p in KDIR.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")


def _gpu_reason():
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): GPU kernel tests not run"
    try:
        import cupy  # noqa: F401
    except Exception as e:  # pragma: no cover
        return f"CuPy not importable ({e}): GPU kernel tests not run"
    return None


GPU_REASON = _gpu_reason()
requires_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
if GPU_REASON:
    print(f"\n[test_kernels] {GPU_REASON}", file=sys.stderr)


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
    every kernel name hvd_ext/kernels.py launches exists as an extern "C" entry point."""
    defined = set()
    for name in K.KERNEL_FILES:
        src = K.kernel_source(name)
        assert "#include" not in src, name
        defined |= set(re.findall(r'extern "C" __global__ void (\w+)', src))
    used = set(re.findall(r'"(hvd_\w+)"', (ROOT / "hvd_ext" / "kernels.py").read_text()))
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
    spec = importlib.util.spec_from_file_location("_hvd_ext_kernels_copy", ROOT / "hvd_ext" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod._force_reference is True
    assert mod.backend(torch.zeros(1)) == "reference"


_CTYPES = {"i64": "int64", "int": "int32", "u32": "uint32", "float": "float32"}
_PTR_DTYPES = {"float": {torch.float32}, "int": {torch.int32}, "u8": {torch.uint8},
               "u32": {torch.int32, torch.uint8}, "u64": {torch.int64}, "i64": {torch.int64}}


def _signatures():
    sigs = {}
    for name in K.KERNEL_FILES:
        src = K.kernel_source(name)
        for fn, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', src, re.S):
            out = []
            for p in params.split(","):
                toks = p.replace("__restrict__", "").replace("const", "").split()
                ptr = "*" in p
                base = toks[0].rstrip("*")
                out.append(("ptr", base) if ptr else ("val", _CTYPES[base]))
            sigs[fn] = out
    return sigs


def test_launch_arguments_match_kernel_signatures(monkeypatch):
    """Without a GPU: drive every CUDA code path with a recording launcher and check each argument
    against the kernel's C signature (count, pointer vs value, element / scalar type)."""
    import numpy as np
    sigs = _signatures()
    calls = []
    monkeypatch.setattr(K, "backend", lambda *t: "cuda")
    monkeypatch.setattr(K, "_grid", lambda work, dev, per_block=256: 1)
    monkeypatch.setattr(K, "_launch", lambda t, mod, fn, grid, block, args, shared_mem=0:
                        calls.append((mod, fn, block, args, shared_mem)))
    x = torch.randn(1000)
    lv = torch.linspace(-1, 1, 8)
    K.pack_bits(torch.zeros(100, dtype=torch.uint8), 3)
    K.unpack_bits(torch.zeros(38, dtype=torch.uint8), 3, 100)
    K.quantize_pack(x, lv, 1.0, 3, 1, 2)
    d = torch.zeros(375, dtype=torch.uint8)
    K.unpack_dequantize_accumulate(torch.zeros(1000), [d, d], lv, [1.0, 2.0], 3, 1000)
    K.sign_pack(x)
    K.majority_vote([torch.zeros(125, dtype=torch.uint8)] * 3, 1000)
    K.residual_update(torch.zeros(1000), x, x)
    K.ewma_update(torch.zeros(1000), x, x > 0, 0.9)
    K.ewma_update(torch.zeros(1000), x, None, 0.9)
    K.sparse_scatter_add(torch.zeros(1000), [torch.arange(5, dtype=torch.int32)], [torch.ones(5)], 0.5)
    K.sparse_scatter_add(torch.zeros(1000), [torch.arange(5)], [torch.ones(5)], 0.5)
    ops = K._CudaOps()
    ops.sample_abs(x, 64, 7)
    inc, counts = ops._block_offsets(x, 0.5)
    ops.hist(x, 0, 31, 19)
    ops.compact(x, 0.5, 3, (inc, counts))
    ops.compact(x, 0.5, 3, None)
    launched = set()
    for mod, fn, block, args, shm in calls:
        launched.add(fn)
        assert block % 32 == 0
        assert fn in sigs and fn in K.kernel_source(mod), fn
        sig = sigs[fn]
        assert len(args) == len(sig), (fn, len(args), len(sig))
        for a, (kind, ty) in zip(args, sig):
            if kind == "ptr":
                if isinstance(a, torch.Tensor):
                    assert a.dtype in _PTR_DTYPES[ty], (fn, ty, a.dtype)
                    assert a.is_contiguous()
                else:
                    assert isinstance(a, np.uint64), (fn, a)
            else:
                assert isinstance(a, np.generic) and a.dtype == np.dtype(ty), (fn, ty, type(a))
    assert launched == set(sigs), set(sigs) - launched


# ---------------------------------------------------------------------------------------------
# counter-based random numbers
# ---------------------------------------------------------------------------------------------

def _py_hash(key, i):
    lo, hi = i & 0xFFFFFFFF, i >> 32
    k = key if hi == 0 else K._mix32_int(key ^ ((hi * 0x9E3779B9) & 0xFFFFFFFF))
    return K._mix32_int(lo ^ k)


def test_hash_tensor_matches_python_ints():
    key = K.stream_key(12345, 77)
    idx = [0, 1, 2, 1000, 2 ** 31 - 1, 2 ** 32 - 1, 2 ** 32, 2 ** 40 + 12345]
    got = K.hash_u32(key, torch.tensor(idx, dtype=torch.int64)).tolist()
    assert got == [_py_hash(key, i) for i in idx]
    assert K.hash_u32(key, torch.tensor(idx[:5])).tolist() == [_py_hash(key, i) for i in idx[:5]]
    # known value of lowbias32 (pins the constants; also written in kernels/common.cuh)
    assert K._mix32_int(1) == _lowbias32_py(1)
    u = K.uniform(key, torch.arange(200_000))
    assert u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert K.stream_key(1, 2) != K.stream_key(2, 1)


def _lowbias32_py(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2 ** 32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2 ** 32
    return x ^ (x >> 16)


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
    bp = pytest.importorskip("hvd_ext.compression.bitpack", reason="hvd_ext/compression/bitpack.py not there yet")
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


def test_select_threshold_sampled_count_within_2x():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g)
    for k in (1, 20, 2000, 20_000):
        for seed in (0, 5):
            idx, val = K.select_threshold(x, k, sample_ratio=0.01, seed=seed)
            _check_selection(x, idx, val, k)
    # heavy tails / layer-like mixture
    y = torch.cat([torch.randn(50_000, generator=g) * 1e-4, torch.randn(150_000, generator=g) ** 3])
    idx, val = K.select_threshold(y, 2000, 0.01, 3)
    _check_selection(y, idx, val, 2000)


def test_select_threshold_exact_equals_brute_force():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50_000, generator=g)
    for k in (1, 17, 500, 49_999):
        idx, val = K.select_threshold(x, k, sample_ratio=1.0)
        ref = torch.topk(x.abs(), k).indices.sort().values
        assert torch.equal(idx.long(), ref)
        assert torch.equal(val, x[ref])


def test_select_threshold_refinement_paths():
    # 1. sample sees only zeros -> count = n -> level-1 histogram finds the 5 spikes exactly
    x = torch.zeros(300_000)
    spikes = torch.tensor([3, 99_999, 150_000, 200_001, 299_999])
    x[spikes] = torch.tensor([5.0, -7.0, 2.0, -3.0, 11.0])
    idx, val = K.select_threshold(x, 5, sample_ratio=0.001, seed=0)
    assert torch.equal(idx.long(), spikes)
    # 2. every |x| in one level-1 bin ([1, 1.0625)) -> level-2 histogram
    g = torch.Generator().manual_seed(3)
    y = (1.0 + torch.randperm(100_000, generator=g).float() * 2 ** -21) * torch.where(
        torch.rand(100_000, generator=g) < 0.5, -1.0, 1.0)
    ops = K._RefOps()
    t, c = K._refine(y, 1000, ops)
    assert 500 <= c <= 2000 and c == int((y.abs() >= t).sum())
    idx, val = K.select_threshold(y, 1000, 0.01, 0)
    _check_selection(y, idx, val, 1000)


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
    idx, _ = K.select_threshold(z, 100, sample_ratio=1.0)
    assert 7 not in idx.tolist()
    with pytest.raises(ValueError):
        K.select_threshold(x, -1)
    with pytest.raises(ValueError):
        K.select_threshold(x, 3, sample_ratio=0)


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
# GPU: kernel == reference
# ---------------------------------------------------------------------------------------------

def _ref(fn, *args, **kw):
    K.use_reference(True)
    try:
        return fn(*args, **kw)
    finally:
        K.use_reference(False)


@requires_gpu
def test_gpu_backend_selected():
    assert K.backend(torch.zeros(1, device="cuda")) == "cuda"
    assert K.backend(torch.zeros(1)) == "reference"


@requires_gpu
@pytest.mark.parametrize("bits", range(1, 9))
def test_gpu_pack_unpack_bit_exact(bits):
    g = torch.Generator().manual_seed(bits)
    for n in (1, 7, 8, 9, 4097, 1_000_003):
        codes = torch.randint(0, 2 ** bits, (n,), generator=g).to(torch.uint8)
        ref = _ref(K.pack_bits, codes, bits)
        got = K.pack_bits(codes.cuda(), bits)
        assert torch.equal(got.cpu(), ref)
        buf = torch.zeros(ref.numel() + 1, dtype=torch.uint8, device="cuda")
        buf[1:] = ref.cuda()                                   # misaligned view
        assert torch.equal(K.unpack_bits(buf[1:], bits, n).cpu(), codes)


@requires_gpu
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_gpu_quantize_pack_bit_exact(bits):
    g = torch.Generator().manual_seed(10 + bits)
    levels = torch.sort(torch.randn(2 ** bits, generator=g)).values
    for n in (1, 13, 100_003):
        x = torch.randn(n + 1, generator=g) * 3
        for xs in (x[:n], x[1:]):                              # aligned and misaligned
            ref = _ref(K.quantize_pack, xs, levels, 1.7, bits, 3, 11)
            got = K.quantize_pack(xs.cuda(), levels.cuda(), 1.7, bits, 3, 11)
            assert torch.equal(got.cpu(), ref)


@requires_gpu
def test_gpu_quantize_unbiased():
    bits, T, n, scale = 2, 200, 4096, 1.0
    levels = torch.linspace(-1, 1, 4, device="cuda")
    x = torch.rand(n, device="cuda") * 2 - 1
    est = torch.zeros(n, device="cuda")
    for step in range(T):
        d = K.quantize_pack(x, levels, scale, bits, seed=1, step=step)
        K.unpack_dequantize_accumulate(est, [d], levels, [scale], bits, n)
    est /= T
    gap = 2 / 3
    assert float((est - x).abs().max()) < 5 * (gap / 2) / math.sqrt(T)
    assert abs(float((est - x).mean())) < 5 * (gap / 2) / math.sqrt(n * T)


@requires_gpu
@pytest.mark.parametrize("N,L", [(3, 8), (40, 256)])        # shared-memory table / global table
def test_gpu_unpack_dequantize_accumulate_bit_exact(N, L):
    bits = int(math.log2(L))
    n = 100_001
    g = torch.Generator().manual_seed(N)
    levels = [torch.sort(torch.randn(L, generator=g)).values for _ in range(N)]
    scales = (torch.rand(N, generator=g) + 0.5).tolist()
    datas = [K.pack_bits(torch.randint(0, L, (n,), generator=g).to(torch.uint8), bits) for _ in range(N)]
    init = torch.randn(n, generator=g)
    ref = _ref(K.unpack_dequantize_accumulate, init.clone(), datas, levels, scales, bits, n)
    got = K.unpack_dequantize_accumulate(init.cuda(), [d.cuda() for d in datas],
                                         [l.cuda() for l in levels], scales, bits, n)
    assert torch.equal(got.cpu(), ref)


@requires_gpu
def test_gpu_select_threshold_same_as_reference():
    g = torch.Generator().manual_seed(20)
    cases = [
        (torch.randn(1_000_003, generator=g), 10_000, 0.01),
        (torch.randn(5_000_000, generator=g) ** 3, 50_000, 0.01),
        (torch.randn(100_000, generator=g), 777, 1.0),                      # exact
    ]
    z = torch.zeros(2_000_000)
    z[torch.randperm(2_000_000, generator=g)[:50]] = torch.randn(50, generator=g)
    cases.append((z, 50, 0.001))                                           # histogram refinement
    y = (1.0 + torch.randperm(300_000, generator=g).float() * 2 ** -21)
    cases.append((y, 1000, 0.01))                                          # second-level histogram
    for x, k, ratio in cases:
        ri, rv = _ref(K.select_threshold, x, k, ratio, 4)
        gi, gv = K.select_threshold(x.cuda(), k, ratio, 4)
        assert torch.equal(gi.cpu(), ri) and torch.equal(gv.cpu(), rv)
        _check_selection(x, ri, rv, k)


@requires_gpu
def test_gpu_sign_majority_bit_exact():
    g = torch.Generator().manual_seed(21)
    for n in (1, 31, 33, 1_000_001):
        xs = [torch.randn(n, generator=g) for _ in range(5)]
        xs[0][: min(n, 3)] = torch.tensor([0.0, -0.0, float("nan")])[: min(n, 3)]
        refs = [_ref(K.sign_pack, x) for x in xs]
        gots = [K.sign_pack(x.cuda()) for x in xs]
        for r, t in zip(refs, gots):
            assert torch.equal(t.cpu(), r)
        for N in (2, 5):
            assert torch.equal(K.majority_vote(gots[:N], n).cpu(), _ref(K.majority_vote, refs[:N], n))


@requires_gpu
def test_gpu_scatter_add_matches():
    g = torch.Generator().manual_seed(22)
    n = 1_000_000
    idxs = [torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32) for k in (10_000, 0, 5, 20_000)]
    vals = [torch.randn(i.numel(), generator=g) for i in idxs]
    ref = _ref(K.sparse_scatter_add, torch.zeros(n), idxs, vals, 0.25)
    got = K.sparse_scatter_add(torch.zeros(n, device="cuda"), [i.cuda() for i in idxs], [v.cuda() for v in vals], 0.25)
    assert torch.allclose(got.cpu(), ref, atol=1e-6)
    got64 = K.sparse_scatter_add(torch.zeros(n, device="cuda"), [i.long().cuda() for i in idxs],
                                 [v.cuda() for v in vals], 0.25)
    assert torch.allclose(got64.cpu(), ref, atol=1e-6)


@requires_gpu
def test_gpu_memory_updates_bit_exact_on_side_stream():
    g = torch.Generator().manual_seed(23)
    n = 1_000_003
    u, sent, S, G = (torch.randn(n, generator=g) for _ in range(4))
    mask = torch.rand(n, generator=g) < 0.1
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        mem = torch.empty(n, device="cuda")
        K.residual_update(mem, u.cuda(), sent.cuda())
        Sg = S.cuda()
        K.ewma_update(Sg, G.cuda(), mask.cuda(), 0.9)
    s.synchronize()
    assert torch.equal(mem.cpu(), _ref(K.residual_update, torch.empty(n), u, sent))
    assert torch.equal(Sg.cpu(), _ref(K.ewma_update, S.clone(), G, mask, 0.9))
