"""GPU kernels for the compression hot loops, with torch reference implementations.

The CUDA sources live in ``kernels/*.cu`` (plain CUDA C++, ``extern "C"`` entry
points): the single source. A *runtime* compiles and launches them:
:class:`CupyRuntime` (the default) compiles with ``cupy.RawModule`` (NVRTC), once
per device, and launches on torch's *current* CUDA stream; torch tensors reach CuPy
through DLPack, zero copy; every output is allocated by torch. The tests install a
CPU execution of the same sources (``tests/cuda_cpu``) with :func:`use_runtime`.

Dispatch: a public function runs the kernel when its tensors are device tensors of
the supported dtype, the runtime can run them, and the reference path is not forced;
otherwise it runs the ``*_reference`` torch implementation, on whatever device the
tensors are. Force the reference path with ``HVD_EXT_KERNELS=reference`` or
``use_reference(True)``; ``backend(tensor)`` says which path a tensor takes.

Failing safe: device tensors without a usable CuPy warn once and take the torch code;
a kernel that fails to compile or launch warns once, naming the kernel and the error,
and the torch code runs for the rest of the run. Launch arguments are checked against
the kernel's C signature (count, types, every tensor on the launch's device), so a
pointer to the wrong memory is refused rather than read.

No host syncs (``docs/gpu.md``): the references and the host logic around the kernels
never read a device value, except the one count ``select_threshold`` must know to size
its output. Pointer tables go up without blocking (``ops.device.upload``). Checks on
device values (indices in range, sorted levels) are ``ops.device.expect``-ed: read at
once outside a pipeline step, with the step's one read inside it.

Kernel and reference give bit-identical results for packing, selection, quantize/pack
codes, dequantize-accumulate, majority vote and the memory updates;
``sparse_scatter_add`` uses float atomics on the GPU, so its sums are equal up to float
rounding order when indices repeat across ranks.

Where the sources are found (``kernel_dir()``): ``$HVD_EXT_KERNEL_DIR`` if set,
else ``hvd_ext/_cu/`` inside the installed package (``setup.py`` copies
``kernels/*.cu`` there at build time), else ``kernels/`` next to the
``hvd_ext`` package (source checkout, ``pip install -e .``).

Counter-based random numbers (``quantize_pack``), identical in CUDA (kernels/common.cuh) and here
(``mix32`` written once for torch and Python ints in ``hvd_ext.ops.hashing``)::

    mix32(x)        = lowbias32: x ^= x>>16; x *= 0x7feb352d; x ^= x>>15; x *= 0x846ca68b; x ^= x>>16
    stream_key(s,t) = mix32(mix32(s ^ 0x9e3779b9) ^ t)            (s, t mod 2^32)
    hash(key, i)    = mix32(lo32(i) ^ k), k = key if hi32(i) == 0 else mix32(key ^ (hi32(i) * 0x9e3779b9 mod 2^32))
    uniform(key, i) = (hash(key, i) >> 8) * 2^-24                  in [0, 1)

BIT ORDER CONTRACT (shared with ``hvd_ext/ops/bits.py``): a
little-endian bitstream; code i occupies stream bits [i*bits, (i+1)*bits),
LSB of the code first; stream bit j is bit (j % 8) of byte j // 8. n codes
take ceil(n*bits/8) bytes; unused high bits of the last byte are 0.
``hvd_ext.ops.bits`` is the one torch implementation of it:
``pack_bits_reference`` / ``unpack_bits_reference`` (and so the torch paths of
``quantize_pack``, ``sign_pack``, ``majority_vote``, ...) delegate there.

Who calls what: the compressors' device paths (``ops.device.on_host`` false) call these
functions; their host paths are their own fused CPU code (``ops.cpu_kernels``).

* bit packing (qsgd, qdist, terngrad, natural, onebit, signsgd family): ``pack_bits`` /
  ``unpack_bits`` / ``sign_pack``;
* sparse ``aggregate`` (topk, threshold, dgc, sig, randomk): ``sparse_scatter_add``;
* ``mode=sampled`` selection (topk, dgc, sig, incl. bucket-wide budgets): ``select_threshold``;
* majority vote (signsgd, signum): ``majority_vote`` (tie handling adapted);
* stochastic rounding (qsgd, qdist, terngrad, int8 ``stochastic=1``): ``quantize_pack``,
  seeded by ``derive_seed(seed, name, rank)`` and the step;
* feedbacks: ``residual_update`` (residual, ewma, dgc_momentum's accumulator) and
  ``ewma_update`` (ewma's S).

Seeds MUST differ per rank (``derive_seed(.., rank)``), else all ranks round the same
way and the rounding errors do not average out.
"""
from __future__ import annotations

import math
import os
import re
import threading
import warnings
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

# the torch bit-packing implementation (absolute import: this file is also loaded standalone by tests)
from hvd_ext.ops import bits as _bitpack
from hvd_ext.ops import hashing as _hash
from hvd_ext.ops.device import compact, expect, in_range, on_host, read, upload

__all__ = [
    "use_reference", "use_runtime", "backend", "kernel_dir", "kernel_source", "kernel_signatures",
    "CupyRuntime", "KernelUnavailable", "derive_seed", "stream_key", "hash_u32", "uniform",
    "select_threshold", "select_threshold_reference", "threshold_for", "compact_ge",
    "sparse_scatter_add", "sparse_scatter_add_reference",
    "pack_bits", "pack_bits_reference", "unpack_bits", "unpack_bits_reference",
    "quantize_pack", "quantize_pack_reference",
    "unpack_dequantize_accumulate", "unpack_dequantize_accumulate_reference",
    "sign_pack", "sign_pack_reference", "majority_vote", "majority_vote_reference",
    "residual_update", "residual_update_reference", "ewma_update", "ewma_update_reference",
    "KERNEL_FILES", "packed_nbytes",
]

KERNEL_FILES = ("sparsify.cu", "quantize.cu", "sign.cu", "memory.cu")

# ---------------------------------------------------------------------------------------------
# dispatch and the kernel runtime
# ---------------------------------------------------------------------------------------------

_force_reference = os.environ.get("HVD_EXT_KERNELS", "").strip().lower() in ("reference", "ref", "torch")
_lock = threading.Lock()
_disabled: Optional[str] = None   # a kernel failed to compile or launch: the torch path from then on
_warned: set = set()


class KernelUnavailable(RuntimeError):
    """A kernel could not be compiled or launched; the caller runs the torch reference instead."""


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class CupyRuntime:
    """Compiles ``kernels/*.cu`` with ``cupy.RawModule`` (NVRTC) once per device and launches on torch's
    current CUDA stream; torch tensors reach CuPy through DLPack, zero copy."""

    name = "cupy"

    def __init__(self):
        self._cupy = None
        self._error: Optional[str] = None
        self._modules: Dict[Tuple[str, int], object] = {}
        self._functions: Dict[Tuple[str, str, int], object] = {}
        self._sm: Dict[int, int] = {}

    def unavailable(self) -> Optional[str]:
        """None when CuPy imports, else why not."""
        if self._cupy is None and self._error is None:
            try:
                import cupy
                self._cupy = cupy
            except Exception as e:  # ImportError, or a broken CUDA install
                self._error = f"{type(e).__name__}: {e}"
        return self._error

    def accepts(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def sm_count(self, device: torch.device) -> int:
        dev = device.index if device.index is not None else torch.cuda.current_device()
        sm = self._sm.get(dev)
        if sm is None:
            sm = self._sm[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
        return sm

    def _function(self, module: str, fn: str, device: int):
        key = (module, fn, device)
        f = self._functions.get(key)
        if f is None:
            cp = self._cupy
            with _lock:
                mod = self._modules.get((module, device))
                with cp.cuda.Device(device):
                    if mod is None:
                        mod = cp.RawModule(code=kernel_source(module), options=("-std=c++14",))
                        self._modules[(module, device)] = mod
                    f = mod.get_function(fn)
                self._functions[key] = f
        return f

    def launch(self, device: torch.device, module: str, fn: str, grid: int, block: int, args,
               shared_mem: int) -> None:
        cp = self._cupy
        dev = device.index if device.index is not None else torch.cuda.current_device()
        f = self._function(module, fn, dev)
        stream = torch.cuda.current_stream(dev)
        with cp.cuda.Device(dev):
            with cp.cuda.ExternalStream(stream.cuda_stream, dev):
                cargs = tuple(cp.from_dlpack(a.detach()) if isinstance(a, torch.Tensor) else a for a in args)
                f((int(grid),), (int(block),), cargs, shared_mem=int(shared_mem))


_runtime = CupyRuntime()


def use_reference(flag: bool = True) -> None:
    """Force (True) or stop forcing (False) the torch reference path for every call."""
    global _force_reference
    _force_reference = bool(flag)


def use_runtime(runtime=None):
    """Launch the kernels with ``runtime`` (an object with ``unavailable``, ``accepts``, ``sm_count`` and
    ``launch`` like :class:`CupyRuntime`; None: a new CuPy runtime) and forget an earlier kernel
    failure. Returns the previous runtime. Tests install a CPU execution of the CUDA sources this way."""
    global _runtime, _disabled
    prev = _runtime
    _runtime = runtime if runtime is not None else CupyRuntime()
    _disabled = None
    _warned.discard("failed")
    _warned.discard("unavailable")
    return prev


def backend(*tensors: torch.Tensor) -> str:
    """``"cuda"`` when the kernels would run for these tensors, else ``"reference"`` (the torch code,
    on whatever device the tensors are). Device tensors without usable kernels warn once."""
    if _force_reference or not tensors or _disabled is not None:
        return "reference"
    if any(on_host(t) for t in tensors) or not all(_runtime.accepts(t) for t in tensors):
        return "reference"
    why = _runtime.unavailable()
    if why is not None:
        _warn_once("unavailable", f"hvd_ext: tensors on {tensors[0].device} but the GPU kernels cannot run ({why}); "
                                  "the torch code runs instead. Install the CuPy wheel of your CUDA major version "
                                  "(cupy-cuda11x, cupy-cuda12x or cupy-cuda13x; scripts/setup.sh picks it), or set "
                                  "HVD_EXT_KERNELS=reference to say the torch code is meant.")
        return "reference"
    return "cuda"


def _cuda(*tensors, dtypes=()) -> bool:
    if backend(*tensors) != "cuda":
        return False
    return all(t.dtype == d for t, d in zip(tensors, dtypes))


def _dispatch(kernel_path, reference_path):
    """The kernel path, or the reference when a kernel cannot be compiled or launched."""
    try:
        return kernel_path()
    except KernelUnavailable:
        return reference_path()


# ---------------------------------------------------------------------------------------------
# the .cu sources, their signatures, launching
# ---------------------------------------------------------------------------------------------

def kernel_dir() -> Path:
    """Directory holding the ``.cu`` sources (see the module docstring for the search order)."""
    env = os.environ.get("HVD_EXT_KERNEL_DIR")
    cands = [Path(env)] if env else []
    package = Path(__file__).resolve().parent.parent  # hvd_ext/
    cands += [package / "_cu", package.parent / "kernels"]
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


_C_TYPES = {"i64": "int64", "int": "int32", "u32": "uint32", "float": "float32"}
_PTR_DTYPES = {"float": (torch.float32,), "int": (torch.int32,), "u8": (torch.uint8, torch.bool),
               "u32": (torch.int32, torch.uint8), "u64": (torch.int64,), "i64": (torch.int64,)}
_signatures: Dict[str, List[Tuple[str, str]]] = {}


def kernel_signatures() -> Dict[str, List[Tuple[str, str]]]:
    """fn -> [("ptr", C base type) | ("val", numpy dtype name)] of every entry point, from the sources."""
    if not _signatures:
        found = {}
        for name in KERNEL_FILES:
            for fn, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', kernel_source(name), re.S):
                out = []
                for p in params.split(","):
                    toks = p.replace("__restrict__", "").replace("const", "").split()
                    base = toks[0].rstrip("*")
                    out.append(("ptr", base) if "*" in p else ("val", _C_TYPES[base]))
                found[fn] = out
        _signatures.update(found)
    return _signatures


def _check_args(fn: str, device: torch.device, args) -> None:
    """Every argument of a launch against the kernel's C signature: count, pointer or value, element /
    scalar type, and every tensor contiguous on the launch's device (a raw pointer into another
    device's memory would be read as garbage, not refused)."""
    sig = kernel_signatures()[fn]
    if len(sig) != len(args):
        raise TypeError(f"{fn}: {len(args)} arguments for a signature of {len(sig)}")
    for i, (a, (kind, ty)) in enumerate(zip(args, sig)):
        if kind == "ptr":
            if isinstance(a, torch.Tensor):
                if a.device != device:
                    raise ValueError(f"{fn}: argument {i} is on {a.device}, the launch on {device}")
                if a.dtype not in _PTR_DTYPES[ty]:
                    raise ValueError(f"{fn}: argument {i} ({ty}*) has dtype {a.dtype}")
                if not a.is_contiguous():
                    raise ValueError(f"{fn}: argument {i} is not contiguous")
            elif not (isinstance(a, np.uint64) and int(a) == 0):
                raise TypeError(f"{fn}: argument {i} ({ty}*) must be a tensor or the null pointer")
        elif not (isinstance(a, np.generic) and a.dtype == np.dtype(ty)):
            raise TypeError(f"{fn}: argument {i} must be numpy {ty}, got {type(a).__name__}")


def _grid(work: int, device: torch.device, per_block: int = 256) -> int:
    """Blocks for a grid-stride kernel: enough to fill the GPU, never more than the work needs."""
    return int(max(1, min(-(-work // per_block), _runtime.sm_count(device) * 16)))


def _launch(device_tensor: torch.Tensor, module: str, fn: str, grid: int, block: int, args, shared_mem: int = 0):
    """Launch ``fn`` on the runtime (torch's current stream of ``device_tensor``'s device). A compile or
    launch failure warns once, naming the kernel and the error, and turns the kernels off for the rest
    of the run (:class:`KernelUnavailable`: the caller runs the torch reference)."""
    global _disabled
    device = device_tensor.device
    _check_args(fn, device, args)
    try:
        _runtime.launch(device, module, fn, grid, block, args, shared_mem)
    except Exception as e:
        _disabled = f"{fn}: {type(e).__name__}: {e}"
        _warn_once("failed", f"hvd_ext: the CUDA kernel {fn} failed ({type(e).__name__}: {str(e)[:300]}); "
                             "the torch code runs instead for the rest of this run")
        raise KernelUnavailable(_disabled) from e


def _ptrs(tensors: Sequence[torch.Tensor], device: torch.device, dtypes: Tuple[torch.dtype, ...],
          what: str) -> torch.Tensor:
    """The device addresses of ``tensors`` as an int64 tensor on ``device``, uploaded without waiting;
    every tensor must be on ``device`` and of one of ``dtypes`` (the kernel reads raw memory)."""
    for i, t in enumerate(tensors):
        if t.device != device:
            raise ValueError(f"{what}: tensor {i} is on {t.device}, the output on {device}")
        if t.dtype not in dtypes:
            raise ValueError(f"{what}: tensor {i} has dtype {t.dtype}; accepted: {', '.join(map(str, dtypes))}")
    return upload([t.data_ptr() for t in tensors], torch.int64, device)


_I64 = np.int64
_I32 = np.int32
_U32 = np.uint32
_F32 = np.float32
_NULL = np.uint64(0)
_M32 = _hash.M32

# ---------------------------------------------------------------------------------------------
# counter-based random numbers (python ints and int64 torch tensors; see the module docstring;
# the hash itself: ``ops.hashing``)
# ---------------------------------------------------------------------------------------------

def stream_key(seed: int, step: int) -> int:
    """32-bit key of the random stream for (seed, step)."""
    return _hash.mix32_int(_hash.mix32_int((int(seed) & _M32) ^ 0x9E3779B9) ^ (int(step) & _M32))


def derive_seed(seed: int, name: str, rank: int = 0) -> int:
    """A seed specific to a tensor name and a rank (use it so ranks round independently)."""
    return _hash.mix32_int(_hash.mix32_int((int(seed) & _M32) ^ zlib.crc32(name.encode()))
                           + (int(rank) & _M32) * 0x85EBCA6B)


def hash_u32(key: int, i: torch.Tensor, below_2_32: Optional[bool] = None) -> torch.Tensor:
    """hash(key, i) for an int64 tensor of non-negative element indices; int64 result in [0, 2^32).
    ``below_2_32``: the caller knows every index is below 2^32 (else it is tested, on the device
    without a read)."""
    i = i.to(torch.int64)
    lo, hi = i & _M32, i >> 32
    lo = (lo - ((lo >> 31) << 32)).to(torch.int32)  # the low 32 bits as an int32 (exact conversion)
    key = _hash.signed32(key)
    if below_2_32 is None and on_host(i):
        below_2_32 = not bool((hi != 0).any())
    if below_2_32:
        k = key
    else:  # hi < 2^31: an exact int32; the int32 multiply wraps (mod 2^32)
        hi = hi.to(torch.int32)
        k = torch.where(hi != 0, _hash.mix32(hi * _hash.signed32(0x9E3779B9) ^ key), torch.full_like(hi, key))
    return _hash.mix32(lo ^ k).to(torch.int64) & _M32


def uniform(key: int, i: torch.Tensor, below_2_32: Optional[bool] = None) -> torch.Tensor:
    """uniform(key, i) as float32 in [0, 1) (24 random bits)."""
    return (hash_u32(key, i, below_2_32) >> 8).to(torch.float32) * (2.0 ** -24)


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
    """Torch path of :func:`pack_bits`: ``hvd_ext.ops.bits.pack_bits`` (the one torch
    implementation of the BIT ORDER CONTRACT), without the range check; only the low ``bits``
    bits of each integer code are used, as in the kernel."""
    return _bitpack.pack_bits(codes, _check_bits(bits), check=False)


def unpack_bits_reference(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Torch path of :func:`unpack_bits`: ``hvd_ext.ops.bits.unpack_bits``."""
    return _bitpack.unpack_bits(data, _check_bits(bits), int(n))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (only the low ``bits`` bits are used) into ceil(n*bits/8) uint8 bytes
    following the BIT ORDER CONTRACT."""
    bits = _check_bits(bits)
    if not _cuda(codes, dtypes=(torch.uint8,)):
        return pack_bits_reference(codes, bits)

    def kernel():
        c = codes.reshape(-1).contiguous()
        n = c.numel()
        nbytes = packed_nbytes(n, bits)
        out = torch.empty(nbytes, dtype=torch.uint8, device=c.device)
        if n:
            _launch(c, "quantize.cu", "hvd_pack_bits", _grid((n + 7) // 8, c.device), 256,
                    (c, _I64(n), _I32(bits), out, _I64(nbytes)))
        return out
    return _dispatch(kernel, lambda: pack_bits_reference(codes, bits))


def unpack_bits(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first n codes (uint8) of the stream ``data``."""
    bits = _check_bits(bits)
    n = int(n)
    d = data.reshape(-1)
    if d.numel() < packed_nbytes(n, bits):
        raise ValueError(f"unpack_bits: need {packed_nbytes(n, bits)} bytes for {n} codes of {bits} bits, "
                         f"got {d.numel()}")
    if not _cuda(data, dtypes=(torch.uint8,)):
        return unpack_bits_reference(data, bits, n)

    def kernel():
        dc = d.contiguous()
        out = torch.empty(n, dtype=torch.uint8, device=dc.device)
        if n:
            _launch(dc, "quantize.cu", "hvd_unpack_bits", _grid((n + 7) // 8, dc.device), 256,
                    (dc, _I64(n), _I32(bits), out))
        return out
    return _dispatch(kernel, lambda: unpack_bits_reference(data, bits, n))


# ---------------------------------------------------------------------------------------------
# stochastic quantization
# ---------------------------------------------------------------------------------------------

def _check_levels(levels: torch.Tensor, bits: int) -> torch.Tensor:
    lv = levels.reshape(-1).to(torch.float32).contiguous()
    L = lv.numel()
    if not 2 <= L <= (1 << bits):
        raise ValueError(f"levels must hold 2..2**bits={1 << bits} values, got {L}")
    expect((lv[1:] >= lv[:-1]).all(), "quantize_pack: levels must be sorted in ascending order (the rounding "
                                      "searches them)")
    return lv


def _inv_scale(scale) -> np.float32:
    s = float(scale)
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"scale must be finite and >= 0, got {s}")
    return np.float32(1.0 / s) if s > 0 else np.float32(0.0)


def quantize_pack_reference(x: torch.Tensor, levels: torch.Tensor, scale, bits: int, seed: int = 0,
                            step: int = 0) -> torch.Tensor:
    bits = _check_bits(bits)
    return _quantize_pack_torch(x, _check_levels(levels, bits), scale, bits, seed, step)


def _quantize_pack_torch(x, lv, scale, bits, seed, step):
    if lv.device != x.device:
        lv = lv.to(x.device)
    L = lv.numel()
    v = x.reshape(-1).to(torch.float32) * torch.tensor(_inv_scale(scale), dtype=torch.float32)
    n = v.numel()
    c = (torch.searchsorted(lv, v, right=True) - 1).clamp_(0, L - 2)
    c = torch.where(torch.isnan(v), torch.zeros_like(c), c)
    a, b = lv[c], lv[c + 1]
    u = uniform(stream_key(seed, step), torch.arange(n, device=v.device, dtype=torch.int64), n <= 2 ** 32)
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
    ``levels`` must be on x's device on a GPU (a host table would be a blocking copy).
    """
    bits = _check_bits(bits)
    lv = _check_levels(levels, bits)
    if not _cuda(x, dtypes=(torch.float32,)):
        return _quantize_pack_torch(x, lv, scale, bits, seed, step)

    def kernel():
        xf = x.reshape(-1).contiguous()
        n = xf.numel()
        nbytes = packed_nbytes(n, bits)
        out = torch.empty(nbytes, dtype=torch.uint8, device=xf.device)
        if n:
            _launch(xf, "quantize.cu", "hvd_quantize_pack", _grid((n + 7) // 8, xf.device), 256,
                    (xf, _I64(n), lv, _I32(lv.numel()), _inv_scale(scale), _U32(stream_key(seed, step)),
                     _I32(bits), out, _I64(nbytes)))
        return out
    return _dispatch(kernel, lambda: _quantize_pack_torch(x, lv, scale, bits, seed, step))


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
        sc = upload([float(s) for s in scales], torch.float32, device)
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
        codes = unpack_bits_reference(d, bits, n).to(torch.int64).clamp_(max=L - 1)
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
    if out.numel() != n:
        raise ValueError(f"out has {out.numel()} elements, expected n={n}")
    need = packed_nbytes(n, bits)
    for d in datas:
        if d.numel() < need:
            raise ValueError(f"payload of {d.numel()} bytes, need {need} for {n} codes of {bits} bits")
    if not datas or not _cuda(out, *datas, dtypes=(torch.float32,) + (torch.uint8,) * len(datas)) \
            or not out.is_contiguous():
        return unpack_dequantize_accumulate_reference(out, datas, levels_list, scales, bits, n)

    def kernel():
        ds = [d.reshape(-1).contiguous() for d in datas]
        tab = _tables(levels_list, scales, len(ds), out.device)
        nranks, L = tab.shape
        use_shared = nranks * L * 4 <= 32768
        if n:
            _launch(out, "quantize.cu", "hvd_unpack_dequant_acc", _grid((n + 7) // 8, out.device), 256,
                    (out, _I64(n), _ptrs(ds, out.device, (torch.uint8,), "unpack_dequantize_accumulate"),
                     _I32(nranks), tab, _I32(L), _I32(bits), _I32(use_shared)),
                    shared_mem=nranks * L * 4 if use_shared else 0)
        return out
    return _dispatch(kernel, lambda: unpack_dequantize_accumulate_reference(out, datas, levels_list, scales, bits, n))


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

    def kernel():
        xf = x.reshape(-1).contiguous()
        n = xf.numel()
        words = (n + 31) // 32
        out = torch.empty(words * 4, dtype=torch.uint8, device=xf.device)
        if n:
            _launch(xf, "sign.cu", "hvd_sign_pack", _grid(words * 32, xf.device), 256, (xf, _I64(n), out))
        return out[:(n + 7) // 8]
    return _dispatch(kernel, lambda: sign_pack_reference(x))


def majority_vote_reference(datas: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    n = int(n)
    if not datas:
        raise ValueError("majority_vote needs at least one payload")
    dev = datas[0].device
    cnt = torch.zeros(n, dtype=torch.int32, device=dev)
    for d in datas:
        cnt += unpack_bits_reference(d, 1, n).to(torch.int32)
    one = torch.ones((), dtype=torch.float32, device=dev)
    return torch.where(2 * cnt >= len(datas), one, -one)


def majority_vote(datas: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    """Element-wise majority of N ranks' ``sign_pack`` payloads: float32 +1 where at least half
    of the ranks have bit 1 (a tie gives +1), else -1."""
    n = int(n)
    if not datas:
        raise ValueError("majority_vote needs at least one payload")
    need = (n + 7) // 8
    for d in datas:
        if d.numel() < need:
            raise ValueError(f"payload of {d.numel()} bytes, need {need} for {n} signs")
    if not _cuda(*datas, dtypes=(torch.uint8,) * len(datas)):
        return majority_vote_reference(datas, n)

    def kernel():
        ds = [d.reshape(-1).contiguous() for d in datas]
        out = torch.empty(n, dtype=torch.float32, device=ds[0].device)
        if n:
            _launch(out, "sign.cu", "hvd_majority_vote", _grid(need, out.device), 256,
                    (out, _I64(n), _ptrs(ds, out.device, (torch.uint8,), "majority_vote"), _I32(len(ds))))
        return out
    return _dispatch(kernel, lambda: majority_vote_reference(datas, n))


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

    def kernel():
        n = memory.numel()
        if n:
            _launch(memory, "memory.cu", "hvd_residual_update", _grid(n, memory.device), 256,
                    (memory, u.reshape(-1).contiguous(), sent.reshape(-1).contiguous(), _I64(n)))
        return memory
    return _dispatch(kernel, lambda: residual_update_reference(memory, u, sent))


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
    b, c = _beta(beta)
    tensors = (S, G) if mask is None else (S, G, mask)
    if not (_cuda(*tensors, dtypes=(torch.float32, torch.float32)) and S.is_contiguous()
            and (mask is None or mask.dtype in (torch.bool, torch.uint8))):
        return ewma_update_reference(S, G, mask, beta)

    def kernel():
        n = S.numel()
        m = _NULL if mask is None else mask.reshape(-1).contiguous().view(torch.uint8)
        if n:
            _launch(S, "memory.cu", "hvd_ewma_update", _grid(n, S.device), 256,
                    (S, G.reshape(-1).contiguous(), m, _I64(n), b, c))
        return S
    return _dispatch(kernel, lambda: ewma_update_reference(S, G, mask, beta))


# ---------------------------------------------------------------------------------------------
# sparse payloads: scatter-add
# ---------------------------------------------------------------------------------------------

def _in_range(idx: torch.Tensor, n: int) -> torch.Tensor:
    return ((idx >= 0) & (idx < n)).all() if idx.numel() else torch.ones((), dtype=torch.bool, device=idx.device)


def sparse_scatter_add_reference(out: torch.Tensor, indices_list: Sequence[torch.Tensor],
                                 values_list: Sequence[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    flat = out.view(-1)
    n = flat.numel()
    s = torch.tensor(np.float32(scale))
    for idx, val in zip(indices_list, values_list):
        if idx.numel():
            raw = idx.reshape(-1).to(device=flat.device, dtype=torch.int64)
            v = val.reshape(-1).to(device=flat.device, dtype=torch.float32)
            i = in_range(raw, n, "sparse_scatter_add")
            if i is not raw:  # out-of-range entries were redirected to 0: they add nothing
                v = torch.where((raw >= 0) & (raw < n), v, 0.0)
            if scale != 1.0:
                v = v * s
            flat.index_add_(0, i, v.to(flat.dtype))
    return out


def sparse_scatter_add(out: torch.Tensor, indices_list: Sequence[torch.Tensor],
                       values_list: Sequence[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """out[idx_r[j]] += scale * val_r[j] for every rank r (one launch for all ranks).

    ``out``: contiguous float32 dense tensor (its flat view is indexed). indices int32 or int64,
    values float32, one pair per rank (lengths may differ, may be empty). Indices may repeat
    across ranks (they add up); on the GPU the adds are float atomics, so the rounding order
    of repeated indices is not fixed. An index outside [0, numel) raises ValueError (on a device
    when the step reads its checks; nothing is written out of bounds). Returns ``out``."""
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

    def kernel():
        idx = [i.reshape(-1).contiguous() for i in indices_list]
        val = [v.reshape(-1).contiguous() for v in values_list]
        lens = [0]
        for i in idx:
            lens.append(lens[-1] + i.numel())
        total = lens[-1]
        if total:
            dev = out.device
            err = torch.zeros(1, dtype=torch.int32, device=dev)
            _launch(out, "sparsify.cu", "hvd_scatter_add", _grid(total, dev), 256,
                    (out, _I64(out.numel()), _ptrs(idx, dev, (torch.int64,) if idx64 else (torch.int32,), "indices"),
                     _ptrs(val, dev, (torch.float32,), "values"), upload(lens, torch.int64, dev), _I32(len(idx)),
                     _I32(1 if idx64 else 0), np.float32(scale), err))
            expect(err[0] == 0, f"sparse_scatter_add: an index outside [0, {out.numel()}) (a corrupt payload?)")
        return out
    return _dispatch(kernel, lambda: sparse_scatter_add_reference(out, indices_list, values_list, scale))


# ---------------------------------------------------------------------------------------------
# threshold selection (threshold on the device, one count read, block-scan compaction)
# ---------------------------------------------------------------------------------------------

HIST_BINS = 4096
_SEL_TILE = 256 * 16       # = SEL_TILE in sparsify.cu


class _RefOps:
    """Selection primitives in torch (any device; no host read)."""

    def hist(self, x, prefix, prefix_shift, shift):
        bits = x.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
        keep = bits <= 0x7F800000
        if prefix is not None:
            keep = keep & ((bits >> prefix_shift) == prefix.to(torch.int64))
        b = torch.where(keep, (bits >> shift) & (HIST_BINS - 1), HIST_BINS)  # the others: one bin past the end
        h = torch.zeros(HIST_BINS + 1, dtype=torch.int64, device=x.device)
        return h.scatter_add_(0, b, torch.ones_like(b))[:HIST_BINS]

    def compact(self, x, t, total):
        idx = compact(x.abs() >= t, total)
        return idx.to(torch.int32), x[idx]


class _CudaOps:
    """Selection primitives on the GPU (kernels in sparsify.cu)."""

    def hist(self, x, prefix, prefix_shift, shift):
        h = torch.zeros(HIST_BINS, dtype=torch.int32, device=x.device)
        p = _NULL if prefix is None else prefix.to(torch.int32).reshape(1)
        _launch(x, "sparsify.cu", "hvd_hist_abs", _grid(x.numel(), x.device, 1024), 1024,
                (x, _I64(x.numel()), p, _I32(prefix_shift), _I32(shift), h))
        return h.to(torch.int64)

    def compact(self, x, t, total):
        n = x.numel()
        blocks = -(-n // _SEL_TILE)
        counts = torch.empty(blocks, dtype=torch.int32, device=x.device)
        _launch(x, "sparsify.cu", "hvd_count_ge", blocks, 256, (x, _I64(n), t, counts))
        offsets = (torch.cumsum(counts, 0, dtype=torch.int64) - counts).contiguous()  # exclusive scan
        idx = torch.empty(total, dtype=torch.int32, device=x.device)
        val = torch.empty(total, dtype=torch.float32, device=x.device)
        if total:
            _launch(x, "sparsify.cu", "hvd_compact_ge", blocks, 256, (x, _I64(n), t, offsets, idx, val))
        return idx, val


def _at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``t[i]`` for a 0-d index tensor, as a gather (indexing by a 0-d tensor reads it on the host)."""
    return t.index_select(0, i.reshape(1)).reshape(())


def _at_or_above(h: torch.Tensor) -> torch.Tensor:
    """ge[b] = #{entries in bins >= b}, with ge[HIST_BINS] = 0."""
    ge = torch.flip(torch.cumsum(torch.flip(h, [0]), 0), [0])
    return torch.cat([ge, ge.new_zeros(1)])


def _hist_threshold(x: torch.Tensor, k: int, ops) -> Tuple[torch.Tensor, torch.Tensor]:
    """(threshold t, #{|x| >= t}) as 0-d device tensors, from two histograms of |x|'s float bits.

    Level 1 bins the top 12 bits (exponent and 3 mantissa bits, bins ~6-12% wide): b is the highest
    bin with at least k elements at or above it. Level 2 bins the next 12 bits inside bin b (24 bits
    in all). The candidates are the edges around the k-th largest |x| at both levels (level 2's low
    and high edge, then level 1's); the one whose count is closest to k in ratio wins (the first of
    equals): about k elements unless ties of |x| make it impossible, and within [k/2, 2k] whenever
    some edge is. Counts are exact; NaN is never counted."""
    h1 = ops.hist(x, None, 31, 19)
    ge1 = _at_or_above(h1)
    b = ((ge1[:HIST_BINS] >= k).sum() - 1).clamp(min=0)
    h2 = ops.hist(x, b, 19, 7)
    ge2 = _at_or_above(h2) + _at(ge1, b + 1)
    b2 = ((ge2[:HIST_BINS] >= k).sum() - 1).clamp(min=0)
    lo2 = (b << 19) | (b2 << 7)
    bits = torch.stack([lo2, lo2 + (1 << 7), b << 19, (b + 1) << 19])
    counts = torch.stack([_at(ge2, b2), _at(ge2, b2 + 1), _at(ge1, b), _at(ge1, b + 1)])
    ratio = torch.where(counts > 0, torch.maximum(counts / k, k / counts.clamp(min=1)), math.inf)
    pick = ratio.argmin()
    t = _at(bits, pick).to(torch.int32).view(torch.float32)
    return t, _at(counts, pick)


def _threshold(x: torch.Tensor, k: int, exact: bool, ops) -> Tuple[torch.Tensor, torch.Tensor]:
    if exact:
        a = x.abs()
        t = torch.topk(torch.where(a == a, a, -1.0), k, sorted=False).values.min().reshape(1)  # NaN: never
        return t, (a >= t).sum()
    t, count = _hist_threshold(x, k, ops)
    return t.reshape(1), count


def _select(x: torch.Tensor, k: int, exact: bool, ops) -> Tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    if k <= 0 or n == 0:
        return (torch.empty(0, dtype=torch.int32, device=x.device), torch.empty(0, dtype=x.dtype, device=x.device))
    if k >= n:
        return torch.arange(n, dtype=torch.int32, device=x.device), x.clone()
    t, count = _threshold(x, k, exact, ops)
    return ops.compact(x, t, int(read(count)[0]))  # the one read: the size of the result


def _check_select(x, k):
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    if not x.is_floating_point():
        raise ValueError(f"select_threshold needs a floating point tensor, got {x.dtype}")
    if x.numel() >= 2 ** 31:
        raise ValueError("select_threshold: tensors of 2^31 elements or more are not supported (int32 indices)")


def _ops_for(xf: torch.Tensor):
    return _CudaOps() if _cuda(xf, dtypes=(torch.float32,)) else _RefOps()


def threshold_for(x: torch.Tensor, k: int, exact: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(t, count): the threshold ``select_threshold`` uses (a 1-element float32 tensor) and how many
    |x| >= t (0-d int64), both on x's device, without a host read (0 < k < numel). Read the counts of
    several selections at once, then :func:`compact_ge` each."""
    _check_select(x, k)
    if not 0 < k < x.numel():
        raise ValueError(f"threshold_for: need 0 < k < numel ({x.numel()}), got k={k}")
    xf = x.reshape(-1).to(torch.float32).contiguous()
    return _dispatch(lambda: _threshold(xf, int(k), exact, _ops_for(xf)), lambda: _threshold(xf, int(k), exact, _RefOps()))


def compact_ge(x: torch.Tensor, t: torch.Tensor, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every i with |x[i]| >= t (``t``: a 1-element float32 tensor on x's device), ascending, as (int32
    indices, float32 values); ``total``: how many there are (from :func:`threshold_for`)."""
    xf = x.reshape(-1).to(torch.float32).contiguous()
    t = t.reshape(1).to(torch.float32).contiguous()
    return _dispatch(lambda: _ops_for(xf).compact(xf, t, int(total)), lambda: _RefOps().compact(xf, t, int(total)))


def select_threshold_reference(x: torch.Tensor, k: int, exact: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_select(x, k)
    return _select(x.reshape(-1).to(torch.float32).contiguous(), int(k), exact, _RefOps())


def select_threshold(x: torch.Tensor, k: int, exact: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """About k coordinates of largest |x|, as (indices int32 ascending, values float32 x[indices]).

    1. threshold t on the device: with ``exact`` the k-th largest |x| (the result is the exact
       top-k, plus ties at t); else from two histograms of |x|'s float bits (``_hist_threshold``):
       the count is about k, within [k/2, 2k] unless ties of |x| make it impossible;
    2. the count #{|x| >= t} is read -- the one host read, to size the result;
    3. one compaction pass: all i with |x[i]| >= t (NaN never selected), ascending, written by a
       block-level scan (no sort). k >= n returns everything; k == 0 nothing. n < 2^31.
    GPU and reference select exactly the same indices.
    """
    _check_select(x, k)
    xf = x.reshape(-1)
    if not _cuda(xf, dtypes=(torch.float32,)):
        return select_threshold_reference(x, k, exact)
    return _dispatch(lambda: _select(xf.contiguous(), int(k), exact, _CudaOps()),
                     lambda: select_threshold_reference(x, k, exact))
