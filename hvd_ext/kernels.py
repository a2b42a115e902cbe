"""GPU kernels for the compression hot loops, with torch reference implementations.

The CUDA sources live in ``kernels/*.cu`` (plain CUDA C++, ``extern "C"`` entry
points). They are compiled at run time by ``cupy.RawModule`` (NVRTC), once per
device (cached in this process and in CuPy's on-disk cache), and launched on
torch's *current* CUDA stream. Torch tensors reach CuPy through DLPack
(``cupy.from_dlpack``), zero copy; every output is allocated by torch.

Dispatch: a public function runs the CUDA kernel when its tensors are CUDA
tensors of the supported dtype, CuPy imports, and the reference path is not
forced; otherwise it runs the ``*_reference`` torch implementation (any device).
Force the reference path with ``HVD_EXT_KERNELS=reference`` in the environment
or ``use_reference(True)``; ``backend(tensor)`` says which path a tensor takes.
Kernel and reference give bit-identical results for packing, selection,
quantize/pack codes, dequantize-accumulate, majority vote and the memory
updates; ``sparse_scatter_add`` uses float atomics on the GPU, so its sums are
equal up to float rounding order when indices repeat across ranks.

Where the sources are found (``kernel_dir()``): ``$HVD_EXT_KERNEL_DIR`` if set,
else ``hvd_ext/_cu/`` inside the installed package (``setup.py`` copies
``kernels/*.cu`` there at build time), else ``kernels/`` next to the
``hvd_ext`` package (source checkout, ``pip install -e .``).

Counter-based random numbers (``quantize_pack``, the sample of
``select_threshold``), identical in CUDA (kernels/common.cuh) and here::

    mix32(x)        = lowbias32: x ^= x>>16; x *= 0x7feb352d; x ^= x>>15; x *= 0x846ca68b; x ^= x>>16
    stream_key(s,t) = mix32(mix32(s ^ 0x9e3779b9) ^ t)            (s, t mod 2^32)
    hash(key, i)    = mix32(lo32(i) ^ k), k = key if hi32(i) == 0 else mix32(key ^ (hi32(i) * 0x9e3779b9 mod 2^32))
    uniform(key, i) = (hash(key, i) >> 8) * 2^-24                  in [0, 1)

BIT ORDER CONTRACT (shared with ``hvd_ext/compression/bitpack.py``): a
little-endian bitstream; code i occupies stream bits [i*bits, (i+1)*bits),
LSB of the code first; stream bit j is bit (j % 8) of byte j // 8. n codes
take ceil(n*bits/8) bytes; unused high bits of the last byte are 0.
``hvd_ext.compression.bitpack`` is the one torch implementation of it:
``pack_bits_reference`` / ``unpack_bits_reference`` (and so the torch paths of
``quantize_pack``, ``sign_pack``, ``majority_vote``, ...) delegate there.

Who calls what (wired; CPU tensors keep the compressors' own torch code, bit for bit)
--------------------------------------------------------------------------------------
* bit packing (qsgd, qdist, terngrad, natural, onebit, signsgd family):
  ``pack_bits`` / ``unpack_bits`` / ``sign_pack`` always (dispatch inside);
* sparse ``aggregate`` (topk, threshold, dgc, sig, randomk): ``sparse_scatter_add`` always;
* ``mode=sampled`` selection (topk, dgc, sig, incl. bucket-wide budgets):
  ``select_threshold`` when ``backend(score) == "cuda"``;
* majority vote (signsgd, signum): ``majority_vote`` on CUDA (tie handling adapted);
* stochastic rounding (qsgd, qdist, terngrad, int8 ``stochastic=1``): ``quantize_pack``
  on CUDA, seeded by ``derive_seed(seed, name, rank)`` and the step (the CPU paths keep
  their ``torch.Generator`` streams, so CPU and GPU draw different random numbers);
* feedbacks: ``residual_update`` (residual, ewma, dgc_momentum's accumulator) and
  ``ewma_update`` (ewma's S) on CUDA.
The CUDA-only paths are gated by ``backend(...)``, so the reference switch covers them.

How a compressor calls these (the payload formats stay the compressors' own)
------------------------------------------------------------------------------
Top-k / threshold sparsifier (payload = k int32 indices + k float32 values, as
``randomk``)::

    idx, val = kernels.select_threshold(u.reshape(-1), k, sample_ratio=0.01,
                                        seed=kernels.derive_seed(seed, info.name, info.rank) ^ info.step)
    payload = as_bytes(idx, val)      # len(idx) varies: k/2 <= len <= 2k (see select_threshold)
    # fixed-size payload wanted? take the top k of (idx, val) by |val| (small), or pad.
    # aggregate():
    out = torch.zeros(info.numel, dtype=torch.float32, device=datas[0].device)
    kernels.sparse_scatter_add(out, [idx_r ...], [val_r ...], scale=1.0)   # the exchange scales by 1/N
    # (or scale=1/N to get the average directly); indices int32/int64, values float32.
    # error feedback: kernels.residual_update(memory, u, sent_dense)  ->  memory = u - sent

b-bit quantizer with a level table (QSGD-like, distribution-fitted levels)::

    levels = sorted float32 tensor, 2 <= len(levels) <= 2**bits, in units of `scale`
    codes  = kernels.quantize_pack(u.reshape(-1), levels, scale, bits,
                                   seed=kernels.derive_seed(seed, info.name, info.rank), step=info.step)
    payload = as_bytes(header..., codes)                  # codes: ceil(n*bits/8) uint8
    # aggregate(): one fused pass over all ranks
    out = torch.zeros(n, dtype=torch.float32, device=dev)
    kernels.unpack_dequantize_accumulate(out, [codes_r ...], [levels_r ...] or levels, [scale_r ...], bits, n)
    # decode() of one rank: the same call with one rank's data.
    # Seeds MUST differ per rank (derive_seed(.., rank)), else all ranks round the
    # same way and the rounding errors do not average out.

signSGD with majority vote::

    payload = kernels.sign_pack(u.reshape(-1))            # ceil(n/8) bytes, bit 1 <=> u >= 0
    dense   = kernels.majority_vote([payload_r ...], n)   # float32 +-1 (tie -> +1)

Feedback memories::

    kernels.residual_update(memory, u, sent)              # memory <- u - sent (in place)
    kernels.ewma_update(S, G, mask, beta)                 # S <- beta*S + (1-beta)*G where mask
"""
from __future__ import annotations

import math
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

# the torch bit-packing implementation (absolute import: this file is also loaded standalone by tests)
from hvd_ext.compression import bitpack as _bitpack

__all__ = [
    "use_reference", "backend", "kernel_dir", "derive_seed", "stream_key", "hash_u32", "uniform",
    "select_threshold", "select_threshold_reference",
    "sparse_scatter_add", "sparse_scatter_add_reference",
    "pack_bits", "pack_bits_reference", "unpack_bits", "unpack_bits_reference",
    "quantize_pack", "quantize_pack_reference",
    "unpack_dequantize_accumulate", "unpack_dequantize_accumulate_reference",
    "sign_pack", "sign_pack_reference", "majority_vote", "majority_vote_reference",
    "residual_update", "residual_update_reference", "ewma_update", "ewma_update_reference",
    "KERNEL_FILES", "packed_nbytes", "kernel_source",
]

KERNEL_FILES = ("sparsify.cu", "quantize.cu", "sign.cu", "memory.cu")

# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------

_force_reference = os.environ.get("HVD_EXT_KERNELS", "").strip().lower() in ("reference", "ref", "torch")
_cupy = None          # module once imported
_cupy_error: Optional[str] = None
_lock = threading.Lock()


def use_reference(flag: bool = True) -> None:
    """Force (True) or stop forcing (False) the torch reference path for every call."""
    global _force_reference
    _force_reference = bool(flag)


def _get_cupy():
    global _cupy, _cupy_error
    if _cupy is None and _cupy_error is None:
        try:
            import cupy  # noqa: F401
            _cupy = cupy
        except Exception as e:  # ImportError, or a broken CUDA install
            _cupy_error = f"{type(e).__name__}: {e}"
    return _cupy


def _on_gpu(t) -> bool:
    """The device predicate of :func:`backend` (one place, so tests can stand in for a GPU)."""
    return isinstance(t, torch.Tensor) and t.is_cuda


def backend(*tensors: torch.Tensor) -> str:
    """``"cuda"`` when the kernels would run for these tensors, else ``"reference"``.

    Compressors and feedbacks ask this before taking a CUDA-only code path (one whose
    torch counterpart is their own CPU code), so ``use_reference(True)`` /
    ``HVD_EXT_KERNELS=reference`` forces the torch path there too."""
    if _force_reference or not tensors:
        return "reference"
    if not all(_on_gpu(t) for t in tensors):
        return "reference"
    return "cuda" if _get_cupy() is not None else "reference"


def _cuda(*tensors, dtypes=()) -> bool:
    if backend(*tensors) != "cuda":
        return False
    return all(t.dtype == d for t, d in zip(tensors, dtypes))


# ---------------------------------------------------------------------------------------------
# loading the .cu sources
# ---------------------------------------------------------------------------------------------

def kernel_dir() -> Path:
    """Directory holding the ``.cu`` sources (see the module docstring for the search order)."""
    env = os.environ.get("HVD_EXT_KERNEL_DIR")
    cands = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    cands += [here / "_cu", here.parent / "kernels"]
    for c in cands:
        if (c / "common.cuh").is_file() and all((c / f).is_file() for f in KERNEL_FILES):
            return c
    raise FileNotFoundError("hvd_ext: CUDA kernel sources not found in " + ", ".join(map(str, cands)))


def kernel_source(name: str) -> str:
    """Source of ``name`` (e.g. ``"quantize.cu"``) with ``common.cuh`` inlined (no include path needed)."""
    d = kernel_dir()
    common = (d / "common.cuh").read_text().replace("#pragma once", "")
    src = (d / name).read_text()
    return src.replace('#include "common.cuh"', common)


_functions: Dict[Tuple[str, str, int], object] = {}
_modules: Dict[Tuple[str, int], object] = {}


def _function(module: str, fn: str, device: int):
    key = (module, fn, device)
    f = _functions.get(key)
    if f is None:
        cp = _get_cupy()
        with _lock:
            mod = _modules.get((module, device))
            with cp.cuda.Device(device):
                if mod is None:
                    mod = cp.RawModule(code=kernel_source(module), options=("-std=c++14",))
                    _modules[(module, device)] = mod
                f = mod.get_function(fn)
            _functions[key] = f
    return f


_sm_count: Dict[int, int] = {}


def _grid(work: int, device: int, per_block: int = 256) -> int:
    """Blocks for a grid-stride kernel: enough to fill the GPU, never more than the work needs."""
    sm = _sm_count.get(device)
    if sm is None:
        sm = _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return int(max(1, min(-(-work // per_block), sm * 16)))


def _launch(device_tensor: torch.Tensor, module: str, fn: str, grid: int, block: int, args, shared_mem: int = 0):
    """Launch ``fn`` on torch's current stream of ``device_tensor``'s device.

    ``args`` items that are torch tensors are handed over through DLPack (zero copy)."""
    cp = _get_cupy()
    dev = device_tensor.device.index
    if dev is None:
        dev = torch.cuda.current_device()
    f = _function(module, fn, dev)
    stream = torch.cuda.current_stream(dev)
    with cp.cuda.Device(dev):
        with cp.cuda.ExternalStream(stream.cuda_stream, dev):
            cargs = tuple(cp.from_dlpack(a.detach()) if isinstance(a, torch.Tensor) else a for a in args)
            f((int(grid),), (int(block),), cargs, shared_mem=int(shared_mem))


def _ptrs(tensors: Sequence[torch.Tensor], device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).to(device, non_blocking=False)


_I64 = np.int64
_I32 = np.int32
_U32 = np.uint32
_F32 = np.float32
_NULL = np.uint64(0)

# ---------------------------------------------------------------------------------------------
# counter-based random numbers (python ints and int64 torch tensors; see the module docstring)
# ---------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mix32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def stream_key(seed: int, step: int) -> int:
    """32-bit key of the random stream for (seed, step)."""
    return _mix32_int(_mix32_int((int(seed) & _M32) ^ 0x9E3779B9) ^ (int(step) & _M32))


def derive_seed(seed: int, name: str, rank: int = 0) -> int:
    """A seed specific to a tensor name and a rank (use it so ranks round independently)."""
    return _mix32_int(_mix32_int((int(seed) & _M32) ^ zlib.crc32(name.encode())) + (int(rank) & _M32) * 0x85EBCA6B)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow: split c in 16-bit halves.
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_u32(key: int, i: torch.Tensor) -> torch.Tensor:
    """hash(key, i) for an int64 tensor of non-negative element indices; int64 result in [0, 2^32)."""
    i = i.to(torch.int64)
    lo, hi = i & _M32, i >> 32
    key &= _M32
    if bool((hi != 0).any()):
        k = torch.where(hi != 0, _mix32(key ^ _mul32(hi, 0x9E3779B9)), torch.full_like(hi, key))
    else:
        k = key
    return _mix32(lo ^ k)


def uniform(key: int, i: torch.Tensor) -> torch.Tensor:
    """uniform(key, i) as float32 in [0, 1) (24 random bits)."""
    return (hash_u32(key, i) >> 8).to(torch.float32) * (2.0 ** -24)


# ---------------------------------------------------------------------------------------------
# bit packing
# ---------------------------------------------------------------------------------------------

def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    return int(bits)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of n codes of ``bits`` bits: ceil(n*bits/8)."""
    return (int(n) * int(bits) + 7) // 8


def pack_bits_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Torch path of :func:`pack_bits`: ``hvd_ext.compression.bitpack.pack_bits`` (the one torch
    implementation of the BIT ORDER CONTRACT), without the range check; only the low ``bits``
    bits of each integer code are used, as in the kernel."""
    return _bitpack.pack_bits(codes, _check_bits(bits), check=False)


def unpack_bits_reference(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Torch path of :func:`unpack_bits`: ``hvd_ext.compression.bitpack.unpack_bits``."""
    return _bitpack.unpack_bits(data, _check_bits(bits), int(n))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (only the low ``bits`` bits are used) into ceil(n*bits/8) uint8 bytes
    following the BIT ORDER CONTRACT."""
    bits = _check_bits(bits)
    if not _cuda(codes, dtypes=(torch.uint8,)):
        return pack_bits_reference(codes, bits)
    c = codes.reshape(-1).contiguous()
    n = c.numel()
    nbytes = packed_nbytes(n, bits)
    out = torch.empty(nbytes, dtype=torch.uint8, device=c.device)
    if n:
        groups = (n + 7) // 8
        _launch(c, "quantize.cu", "hvd_pack_bits", _grid(groups, c.device.index), 256,
                (c, _I64(n), _I32(bits), out, _I64(nbytes)))
    return out


def unpack_bits(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first n codes (uint8) of the stream ``data``."""
    bits = _check_bits(bits)
    if not _cuda(data, dtypes=(torch.uint8,)):
        return unpack_bits_reference(data, bits, n)
    n = int(n)
    d = data.reshape(-1).contiguous()
    if d.numel() < packed_nbytes(n, bits):
        raise ValueError(f"unpack_bits: need {packed_nbytes(n, bits)} bytes for {n} codes of {bits} bits, "
                         f"got {d.numel()}")
    out = torch.empty(n, dtype=torch.uint8, device=d.device)
    if n:
        _launch(d, "quantize.cu", "hvd_unpack_bits", _grid((n + 7) // 8, d.device.index), 256,
                (d, _I64(n), _I32(bits), out))
    return out


# ---------------------------------------------------------------------------------------------
# stochastic quantization
# ---------------------------------------------------------------------------------------------

def _check_levels(levels: torch.Tensor, bits: int) -> torch.Tensor:
    lv = levels.reshape(-1).to(torch.float32).contiguous()
    L = lv.numel()
    if not 2 <= L <= (1 << bits):
        raise ValueError(f"levels must hold 2..2**bits={1 << bits} values, got {L}")
    return lv


def _inv_scale(scale) -> np.float32:
    s = float(scale)
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"scale must be finite and >= 0, got {s}")
    return np.float32(1.0 / s) if s > 0 else np.float32(0.0)


def quantize_pack_reference(x: torch.Tensor, levels: torch.Tensor, scale, bits: int, seed: int = 0,
                            step: int = 0) -> torch.Tensor:
    bits = _check_bits(bits)
    lv = _check_levels(levels, bits).to(x.device)
    L = lv.numel()
    v = x.reshape(-1).to(torch.float32) * torch.tensor(_inv_scale(scale), dtype=torch.float32)
    n = v.numel()
    c = (torch.searchsorted(lv, v, right=True) - 1).clamp_(0, L - 2)
    c = torch.where(torch.isnan(v), torch.zeros_like(c), c)
    a, b = lv[c], lv[c + 1]
    u = uniform(stream_key(seed, step), torch.arange(n, device=v.device, dtype=torch.int64))
    codes = c + ((u * (b - a)) < (v - a)).to(c.dtype)
    return pack_bits_reference(codes, bits)


def quantize_pack(x: torch.Tensor, levels: torch.Tensor, scale, bits: int, seed: int = 0,
                  step: int = 0) -> torch.Tensor:
    """Stochastically round x/scale to the sorted ``levels`` and pack the level indices.

    v = x * float32(1/scale) (scale 0 gives v = 0); c = clamp(#{levels <= v} - 1, 0, L-2);
    a, b = levels[c], levels[c+1]; code = c + (u * (b - a) < v - a) in float32 with
    u = uniform(stream_key(seed, step), i), i.e. rounds up with probability (v - a)/(b - a), so
    E[levels[code]] = v inside [levels[0], levels[-1]] (up to 2^-23 relative);
    values outside are clamped to the end levels; NaN gives code 0. Returns ceil(n*bits/8)
    uint8 bytes (BIT ORDER CONTRACT). Codes are bit-identical between kernel and reference.
    """
    bits = _check_bits(bits)
    lv = _check_levels(levels, bits)
    if not _cuda(x, dtypes=(torch.float32,)):
        return quantize_pack_reference(x, lv, scale, bits, seed, step)
    xf = x.reshape(-1).contiguous()
    lv = lv.to(xf.device)
    n = xf.numel()
    nbytes = packed_nbytes(n, bits)
    out = torch.empty(nbytes, dtype=torch.uint8, device=xf.device)
    if n:
        _launch(xf, "quantize.cu", "hvd_quantize_pack", _grid((n + 7) // 8, xf.device.index), 256,
                (xf, _I64(n), lv, _I32(lv.numel()), _inv_scale(scale), _U32(stream_key(seed, step)),
                 _I32(bits), out, _I64(nbytes)))
    return out


def _tables(levels_list, scales, nranks: int, device) -> torch.Tensor:
    """(nranks, L) float32 table levels_r * scale_r, computed by one torch op (same bits anywhere)."""
    if isinstance(levels_list, torch.Tensor):
        lv = levels_list.to(device=device, dtype=torch.float32)
        lv = lv.reshape(1, -1).expand(nranks, -1) if lv.dim() == 1 else lv.reshape(nranks, -1)
    else:
        if len(levels_list) != nranks:
            raise ValueError(f"levels_list has {len(levels_list)} entries for {nranks} ranks")
        lv = torch.stack([l.reshape(-1).to(device=device, dtype=torch.float32) for l in levels_list])
    if isinstance(scales, torch.Tensor):
        sc = scales.reshape(-1).to(device=device, dtype=torch.float32)
    else:
        sc = torch.tensor([float(s) for s in scales], dtype=torch.float32, device=device)
    if sc.numel() != nranks:
        raise ValueError(f"scales has {sc.numel()} entries for {nranks} ranks")
    return (lv * sc[:, None]).contiguous()


def unpack_dequantize_accumulate_reference(out: torch.Tensor, datas: Sequence[torch.Tensor], levels_list,
                                           scales, bits: int, n: int) -> torch.Tensor:
    bits = _check_bits(bits)
    n = int(n)
    flat = out.view(-1)
    if flat.numel() != n:
        raise ValueError(f"out has {flat.numel()} elements, expected n={n}")
    if not datas:
        return out
    tab = _tables(levels_list, scales, len(datas), out.device)
    L = tab.shape[1]
    for r, d in enumerate(datas):
        codes = unpack_bits_reference(d.to(out.device), bits, n).to(torch.int64).clamp_(max=L - 1)
        flat.add_(tab[r][codes].to(flat.dtype))
    return out


def unpack_dequantize_accumulate(out: torch.Tensor, datas: Sequence[torch.Tensor], levels_list,
                                 scales, bits: int, n: int) -> torch.Tensor:
    """out += sum_r levels_r[code_r] * scale_r, decoding N ranks' ``quantize_pack`` payloads in one pass.

    ``out``: contiguous float32, n elements (zeros for a plain sum). ``datas``: N uint8 tensors of at
    least ceil(n*bits/8) bytes. ``levels_list``: one levels tensor shared by all ranks, a list of N,
    or an (N, L) tensor. ``scales``: N floats or a tensor. Ranks are added in order 0..N-1 (the
    result is deterministic and identical to the reference). Returns ``out``.
    """
    bits = _check_bits(bits)
    n = int(n)
    if not datas or not _cuda(out, *datas, dtypes=(torch.float32,) + (torch.uint8,) * len(datas)) \
            or not out.is_contiguous():
        return unpack_dequantize_accumulate_reference(out, datas, levels_list, scales, bits, n)
    if out.numel() != n:
        raise ValueError(f"out has {out.numel()} elements, expected n={n}")
    need = packed_nbytes(n, bits)
    ds = [d.reshape(-1).contiguous() for d in datas]
    for d in ds:
        if d.numel() < need:
            raise ValueError(f"payload of {d.numel()} bytes, need {need} for {n} codes of {bits} bits")
    tab = _tables(levels_list, scales, len(ds), out.device)
    nranks, L = tab.shape
    use_shared = nranks * L * 4 <= 32768
    if n:
        _launch(out, "quantize.cu", "hvd_unpack_dequant_acc", _grid((n + 7) // 8, out.device.index), 256,
                (out, _I64(n), _ptrs(ds, out.device), _I32(nranks), tab, _I32(L), _I32(bits), _I32(use_shared)),
                shared_mem=nranks * L * 4 if use_shared else 0)
    return out


# ---------------------------------------------------------------------------------------------
# sign / majority vote
# ---------------------------------------------------------------------------------------------

def sign_pack_reference(x: torch.Tensor) -> torch.Tensor:
    return pack_bits_reference((x.reshape(-1) >= 0).to(torch.uint8), 1)


def sign_pack(x: torch.Tensor) -> torch.Tensor:
    """1 bit per element, bit = 1 where x >= 0 (+0.0 and -0.0 included), 0 where x < 0 or NaN.
    ceil(n/8) uint8 bytes, element i in bit i%8 of byte i//8 (BIT ORDER CONTRACT, bits=1)."""
    if not _cuda(x, dtypes=(torch.float32,)):
        return sign_pack_reference(x)
    xf = x.reshape(-1).contiguous()
    n = xf.numel()
    words = (n + 31) // 32
    out = torch.empty(words * 4, dtype=torch.uint8, device=xf.device)
    if n:
        _launch(xf, "sign.cu", "hvd_sign_pack", _grid(words * 32, xf.device.index), 256,
                (xf, _I64(n), out))
    return out[:(n + 7) // 8]


def majority_vote_reference(datas: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    n = int(n)
    if not datas:
        raise ValueError("majority_vote needs at least one payload")
    dev = datas[0].device
    cnt = torch.zeros(n, dtype=torch.int32, device=dev)
    for d in datas:
        cnt += unpack_bits_reference(d.to(dev), 1, n).to(torch.int32)
    one = torch.ones((), dtype=torch.float32, device=dev)
    return torch.where(2 * cnt >= len(datas), one, -one)


def majority_vote(datas: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    """Element-wise majority of N ranks' ``sign_pack`` payloads: float32 +1 where at least half
    of the ranks have bit 1 (a tie gives +1), else -1."""
    n = int(n)
    if not datas:
        raise ValueError("majority_vote needs at least one payload")
    if not _cuda(*datas, dtypes=(torch.uint8,) * len(datas)):
        return majority_vote_reference(datas, n)
    need = (n + 7) // 8
    ds = [d.reshape(-1).contiguous() for d in datas]
    for d in ds:
        if d.numel() < need:
            raise ValueError(f"payload of {d.numel()} bytes, need {need} for {n} signs")
    out = torch.empty(n, dtype=torch.float32, device=ds[0].device)
    if n:
        _launch(out, "sign.cu", "hvd_majority_vote", _grid(need, out.device.index), 256,
                (out, _I64(n), _ptrs(ds, out.device), _I32(len(ds))))
    return out


# ---------------------------------------------------------------------------------------------
# fused memory updates
# ---------------------------------------------------------------------------------------------

def residual_update_reference(memory: torch.Tensor, u: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    memory.copy_((u.reshape(memory.shape) - sent.reshape(memory.shape)))
    return memory


def residual_update(memory: torch.Tensor, u: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """memory <- u - sent, in place, one pass (residual error feedback). Returns ``memory``."""
    if memory.numel() != u.numel() or memory.numel() != sent.numel():
        raise ValueError(f"residual_update: sizes differ ({memory.numel()}, {u.numel()}, {sent.numel()})")
    if not (_cuda(memory, u, sent, dtypes=(torch.float32,) * 3) and memory.is_contiguous()):
        return residual_update_reference(memory, u, sent)
    n = memory.numel()
    if n:
        _launch(memory, "memory.cu", "hvd_residual_update", _grid(n, memory.device.index), 256,
                (memory, u.reshape(-1).contiguous(), sent.reshape(-1).contiguous(), _I64(n)))
    return memory


def _beta(beta) -> Tuple[np.float32, np.float32]:
    b = float(beta)
    if not 0.0 <= b <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {b}")
    return np.float32(b), np.float32(1.0 - b)


def ewma_update_reference(S: torch.Tensor, G: torch.Tensor, mask: Optional[torch.Tensor], beta) -> torch.Tensor:
    b, c = _beta(beta)
    new = S * torch.tensor(b) + G.reshape(S.shape).to(S.dtype) * torch.tensor(c)
    if mask is None:
        S.copy_(new)
    else:
        S.copy_(torch.where(mask.reshape(S.shape).to(torch.bool), new, S))
    return S


def ewma_update(S: torch.Tensor, G: torch.Tensor, mask: Optional[torch.Tensor], beta) -> torch.Tensor:
    """S <- beta*S + (1-beta)*G where ``mask`` (bool, same numel) is True, everywhere when mask is None.
    beta and 1-beta are rounded to float32; products and sum rounded separately (no FMA). In place."""
    if S.numel() != G.numel() or (mask is not None and mask.numel() != S.numel()):
        raise ValueError("ewma_update: S, G and mask must have the same number of elements")
    tensors = (S, G) if mask is None else (S, G, mask)
    if not (_cuda(*tensors, dtypes=(torch.float32, torch.float32)) and S.is_contiguous()
            and (mask is None or mask.dtype in (torch.bool, torch.uint8))):
        return ewma_update_reference(S, G, mask, beta)
    b, c = _beta(beta)
    n = S.numel()
    m = _NULL if mask is None else mask.reshape(-1).contiguous().view(torch.uint8)
    if n:
        _launch(S, "memory.cu", "hvd_ewma_update", _grid(n, S.device.index), 256,
                (S, G.reshape(-1).contiguous(), m, _I64(n), b, c))
    return S


# ---------------------------------------------------------------------------------------------
# sparse payloads: scatter-add
# ---------------------------------------------------------------------------------------------

def sparse_scatter_add_reference(out: torch.Tensor, indices_list: Sequence[torch.Tensor],
                                 values_list: Sequence[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    flat = out.view(-1)
    s = torch.tensor(np.float32(scale))
    for idx, val in zip(indices_list, values_list):
        if idx.numel():
            v = val.reshape(-1).to(device=flat.device, dtype=torch.float32)
            if scale != 1.0:
                v = v * s
            flat.index_add_(0, idx.reshape(-1).to(device=flat.device, dtype=torch.int64), v.to(flat.dtype))
    return out


def sparse_scatter_add(out: torch.Tensor, indices_list: Sequence[torch.Tensor],
                       values_list: Sequence[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """out[idx_r[j]] += scale * val_r[j] for every rank r (one launch for all ranks).

    ``out``: contiguous float32 dense tensor (its flat view is indexed). indices int32 or int64,
    values float32, one pair per rank (lengths may differ, may be empty). Indices may repeat
    across ranks (they add up); on the GPU the adds are float atomics, so the rounding order
    of repeated indices is not fixed. Returns ``out``."""
    if len(indices_list) != len(values_list):
        raise ValueError("sparse_scatter_add: indices_list and values_list differ in length")
    for i, v in zip(indices_list, values_list):
        if i.numel() != v.numel():
            raise ValueError(f"sparse_scatter_add: {i.numel()} indices but {v.numel()} values")
    if not indices_list:
        return out
    idx64 = all(i.dtype == torch.int64 for i in indices_list)
    if not (_cuda(out, *indices_list, *values_list) and out.dtype == torch.float32 and out.is_contiguous()
            and all(v.dtype == torch.float32 for v in values_list)
            and (idx64 or all(i.dtype == torch.int32 for i in indices_list))):
        return sparse_scatter_add_reference(out, indices_list, values_list, scale)
    idx = [i.reshape(-1).contiguous() for i in indices_list]
    val = [v.reshape(-1).contiguous() for v in values_list]
    lens = [0]
    for i in idx:
        lens.append(lens[-1] + i.numel())
    total = lens[-1]
    if total:
        offsets = torch.tensor(lens, dtype=torch.int64).to(out.device)
        _launch(out, "sparsify.cu", "hvd_scatter_add", _grid(total, out.device.index), 256,
                (out, _ptrs(idx, out.device), _ptrs(val, out.device), offsets, _I32(len(idx)),
                 _I32(1 if idx64 else 0), np.float32(scale)))
    return out


# ---------------------------------------------------------------------------------------------
# threshold selection (sampled threshold, histogram refinement, block-scan compaction)
# ---------------------------------------------------------------------------------------------

MIN_SAMPLE = 1024          # never estimate the threshold from fewer samples
HIST_BINS = 4096
_SEL_TILE = 256 * 16       # = SEL_TILE in sparsify.cu
_SAMPLE_STEP = 0x5E1EC7    # step value of the sampling stream: stream_key(seed, _SAMPLE_STEP)


def _bits_to_float(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", int(b) & _M32))[0]


def _ratio(c: int, k: int) -> float:
    return max(c / k, k / c) if c > 0 else math.inf


class _RefOps:
    """Selection primitives in torch (any device)."""

    def sample_abs(self, x, m, key):
        n = x.numel()
        i = hash_u32(key, torch.arange(m, device=x.device, dtype=torch.int64)) % n
        return x[i].abs()

    def count(self, x, t):
        return int((x.abs() >= t).sum()), None

    def hist(self, x, prefix, prefix_shift, shift):
        bits = x.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
        keep = (bits <= 0x7F800000) & ((bits >> prefix_shift) == prefix)
        b = (bits[keep] >> shift) & (HIST_BINS - 1)
        return torch.bincount(b, minlength=HIST_BINS).cpu()

    def compact(self, x, t, total, state):
        idx = torch.nonzero(x.abs() >= t).reshape(-1)
        return idx.to(torch.int32), x[idx]


class _CudaOps:
    """Selection primitives on the GPU (kernels in sparsify.cu)."""

    def sample_abs(self, x, m, key):
        out = torch.empty(m, dtype=torch.float32, device=x.device)
        _launch(x, "sparsify.cu", "hvd_sample_abs", _grid(m, x.device.index), 256,
                (x, _I64(x.numel()), out, _I64(m), _U32(key)))
        return out

    def _block_offsets(self, x, t):
        n = x.numel()
        blocks = -(-n // _SEL_TILE)
        counts = torch.empty(blocks, dtype=torch.int32, device=x.device)
        _launch(x, "sparsify.cu", "hvd_count_ge", blocks, 256, (x, _I64(n), np.float32(t), counts))
        inc = torch.cumsum(counts, 0, dtype=torch.int64)
        return inc, counts

    def count(self, x, t):
        inc, counts = self._block_offsets(x, t)
        return int(inc[-1]), (inc, counts)          # the one device->host sync of the fast path

    def hist(self, x, prefix, prefix_shift, shift):
        h = torch.zeros(HIST_BINS, dtype=torch.int32, device=x.device)
        _launch(x, "sparsify.cu", "hvd_hist_abs", _grid(x.numel(), x.device.index, 1024), 1024,
                (x, _I64(x.numel()), _U32(prefix), _I32(prefix_shift), _I32(shift), h))
        return h.cpu().to(torch.int64)

    def compact(self, x, t, total, state):
        if state is None:
            state = self._block_offsets(x, t)          # total already known: no sync
        inc, counts = state
        offsets = (inc - counts).contiguous()          # exclusive scan of the block counts
        idx = torch.empty(total, dtype=torch.int32, device=x.device)
        val = torch.empty(total, dtype=torch.float32, device=x.device)
        if total:
            _launch(x, "sparsify.cu", "hvd_compact_ge", offsets.numel(), 256,
                    (x, _I64(x.numel()), np.float32(t), offsets, idx, val))
        return idx, val


def _pick(k: int, cands: List[Tuple[float, int]]) -> Tuple[float, int]:
    """First candidate (threshold, count) within [k/2, 2k], else the one closest to k in ratio."""
    for t, c in cands:
        if k / 2 <= c <= 2 * k:
            return t, c
    return min(cands, key=lambda tc: _ratio(tc[1], k))


def _refine(x, k, ops) -> Tuple[float, int]:
    """Threshold from a histogram of the float bits of |x| (12 bits: exponent + 3 mantissa bits,
    bins ~6-12% wide), and a second histogram inside the chosen bin when that bin alone holds
    too many elements (24 bits in all). Counts are exact, no further pass needed."""
    h1 = ops.hist(x, 0, 31, 19)
    ge1 = torch.flip(torch.cumsum(torch.flip(h1, [0]), 0), [0]).tolist() + [0]   # ge1[b] = #{bin >= b}
    b = max((i for i in range(HIST_BINS) if ge1[i] >= k), default=0)
    lo = (_bits_to_float(b << 19), ge1[b])
    hi = (_bits_to_float((b + 1) << 19), ge1[b + 1])
    if k / 2 <= lo[1] <= 2 * k or k / 2 <= hi[1] <= 2 * k:
        return _pick(k, [lo, hi])
    h2 = ops.hist(x, b, 19, 7)
    ge2 = [v + ge1[b + 1] for v in torch.flip(torch.cumsum(torch.flip(h2, [0]), 0), [0]).tolist()] + [ge1[b + 1]]
    b2 = max((i for i in range(HIST_BINS) if ge2[i] >= k), default=0)
    lo2 = (_bits_to_float((b << 19) | (b2 << 7)), ge2[b2])
    hi2 = (_bits_to_float(((b << 19) | (b2 << 7)) + (1 << 7)), ge2[b2 + 1])
    return _pick(k, [lo2, hi2, lo, hi])


def _select(x: torch.Tensor, k: int, sample_ratio: float, seed: int, ops) -> Tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    if n >= 2 ** 31:
        raise ValueError("select_threshold: tensors of 2^31 elements or more are not supported (int32 indices)")
    if k <= 0 or n == 0:
        return (torch.empty(0, dtype=torch.int32, device=x.device), torch.empty(0, dtype=x.dtype, device=x.device))
    if k >= n:
        return torch.arange(n, dtype=torch.int32, device=x.device), x.clone()
    m = n if sample_ratio >= 1 else min(n, max(MIN_SAMPLE, math.ceil(sample_ratio * n)))
    if m >= n:
        sample, ks = x.abs(), k                        # exact: t = k-th largest |x|
    else:
        sample = ops.sample_abs(x, m, stream_key(seed, _SAMPLE_STEP))
        ks = max(1, min(m, int(round(k * m / n))))
    t = float(torch.topk(sample, ks, sorted=False).values.min())
    total, state = ops.count(x, t)
    if not (k / 2 <= total <= 2 * k) and m < n:
        t, total = _refine(x, k, ops)
        state = None
    return ops.compact(x, t, total, state)


def _check_select(x, k, sample_ratio):
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    if not (isinstance(sample_ratio, (int, float)) and sample_ratio > 0):
        raise ValueError(f"sample_ratio must be > 0, got {sample_ratio!r}")
    if not x.is_floating_point():
        raise ValueError(f"select_threshold needs a floating point tensor, got {x.dtype}")


def select_threshold_reference(x: torch.Tensor, k: int, sample_ratio: float = 0.01,
                               seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_select(x, k, sample_ratio)
    return _select(x.reshape(-1).to(torch.float32).contiguous(), int(k), sample_ratio, seed, _RefOps())


def select_threshold(x: torch.Tensor, k: int, sample_ratio: float = 0.01,
                     seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """About k coordinates of largest |x|, as (indices int32 ascending, values float32 x[indices]).

    1. m = max(1024, ceil(sample_ratio*n)) samples |x[hash(key, j) mod n]|, key = stream_key(seed,
       0x5e1ec7); threshold t = the round(k*m/n)-th largest sample. sample_ratio >= 1 (or m >= n)
       uses all of x: t = the exact k-th largest |x| and the result is the exact top-k (plus
       ties at t).
    2. count c = #{|x| >= t}; if c is outside [k/2, 2k]: one histogram pass over the float bits
       of |x| (and a second, inside one bin, only when a single bin holds too many) sets t so
       that c is within [k/2, 2k] unless ties of |x| make it impossible.
    3. one compaction pass: all i with |x[i]| >= t (NaN never selected), ascending, written by
       a block-level scan (no sort). k >= n returns everything; k == 0 nothing. n < 2^31.
    GPU and reference select exactly the same indices.
    """
    _check_select(x, k, sample_ratio)
    xf = x.reshape(-1)
    if not _cuda(xf, dtypes=(torch.float32,)):
        return select_threshold_reference(x, k, sample_ratio, seed)
    return _select(xf.contiguous(), int(k), sample_ratio, seed, _CudaOps())
