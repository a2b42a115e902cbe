"""Fast CPU paths of the codecs (not a compressor itself).

Three tools keep the CPU codecs near memory bandwidth:

* **Fused kernels.** Each codec writes its hot loop (quantize + pack, unpack +
  dequantize + sum over ranks) as one pure torch function of whole tensors, no
  Python loop over elements or chunks. :class:`Kernel` runs it compiled by
  ``torch.compile`` (inductor's C++/OpenMP code generation on CPU, one
  vectorised loop instead of one pass and one temporary per operator) for large
  CPU tensors, and eagerly otherwise. A compiler failure is caught once,
  remembered, reported with a warning, and the eager function runs from then
  on: results are the same either way (same integer hash, same formula; float
  sums may differ in the last bit from a different summation order).

  ``HVD_EXT_COMPILE``: ``auto`` (default) compiles for CPU tensors of at least
  ``HVD_EXT_COMPILE_MIN`` elements (default 2^20, so unit tests on small
  tensors never wait for a compiler), ``1``/``on`` for every CPU tensor,
  ``0``/``off`` never. Each kernel is compiled once per (configuration, tensor
  shape) with static shapes; the first call of a specialisation takes seconds
  (tens of seconds for the first one of a process when inductor's on-disk cache
  is cold), later calls reuse it.

* **Counter-based random numbers** for stochastic rounding
  (:func:`uniform`): element i of a stream gets ``hash(key ^ i)``, the 32-bit
  integer finaliser "lowbias32" (C. Wellons, "Prospecting for hash functions",
  2018), written once in ``hvd_ext.ops.hashing`` (also behind ``cuda_kernels.hash_u32``
  and the same as the CUDA kernels' hash) --
  with the top 24 bits as ``u = h / 2^24`` in [0, 1). Stateless: a rank's
  rounding is a function of (seed, tensor name, rank, step, i), so checkpoints
  resume exactly and compiled and eager paths agree bit for bit. No generator
  state, no float64, about 10 integer operations per element fused into the
  quantizer. Rounding ``x`` up with probability ``p`` when ``u < p`` is unbiased
  up to 2^-24 (u takes 2^24 equally likely values), below float32's own rounding
  of p; tests check the unbiasedness statistically.

* **Reused scratch buffers** (:func:`scratch`), keyed by (purpose, shape, dtype):
  for large temporaries that would otherwise be freshly mapped (and page-faulted)
  every step. Outputs handed to the caller are always fresh tensors.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from ..ops import bits as _bits
from ..ops import cuda_kernels as _K
from ..ops.hashing import hash32, mix32_, signed32

__all__ = ["Kernel", "compile_enabled", "uniform", "stream_key_tensor", "codes_buffer",
           "pack_buffer", "unpack_to_buffer", "scratch", "empty"]

_SETTING = os.environ.get("HVD_EXT_COMPILE", "auto").strip().lower()
MIN_NUMEL = int(os.environ.get("HVD_EXT_COMPILE_MIN", str(1 << 20)))
_lock = threading.Lock()


def compile_enabled(numel: int, device=None) -> bool:
    """Whether a kernel call on ``numel`` elements of ``device`` runs compiled (see the module docstring)."""
    if device is not None and torch.device(device).type != "cpu":
        return False
    if _SETTING in ("0", "off", "false", "no", "eager"):
        return False
    if _SETTING in ("1", "on", "true", "yes", "always"):
        return True
    return numel >= MIN_NUMEL


MAX_SPECIALISATIONS = 64  # per kernel; beyond that, new shapes run eagerly


def _shape_key(args) -> Tuple:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((tuple(a.shape), a.dtype))
        elif isinstance(a, (list, tuple)):
            out.append(_shape_key(a))
        else:
            out.append(a)
    return tuple(out)


class Kernel:
    """A pure torch function run compiled for large CPU tensors, eagerly otherwise.

    ``kernel(numel, device, *args, **static)``: keyword arguments are static configuration
    (bits, levels, ...). Each distinct (configuration, argument shapes, integer arguments) is
    compiled once with static shapes, as its own code object (so dynamo's per-function
    recompilation limit never applies and every specialisation gets fully vectorised loops
    without symbolic index arithmetic); a model has few distinct large tensor shapes. Beyond
    ``MAX_SPECIALISATIONS`` new shapes run eagerly. A failure to compile or to run compiled is
    caught once, remembered (``self.failed``) and warned about, and the eager function is used
    from then on."""

    def __init__(self, fn: Callable, name: str = ""):
        self.fn = fn
        self.name = name or fn.__name__
        self._compiled: Dict[Tuple, Callable] = {}
        self.failed = None

    def _get(self, args, static: Dict):
        key = (tuple(sorted(static.items())), _shape_key(args))
        f = self._compiled.get(key)
        if f is None:
            if len(self._compiled) >= MAX_SPECIALISATIONS:
                return None
            with _lock:
                f = self._compiled.get(key)
                if f is None:
                    # a fresh code object per specialisation: dynamo caches (and limits recompiles)
                    # per code object, and treats the captured configuration as constants
                    ns = {"fn": self.fn, "static": static}
                    exec(f"def _hvd_kernel_{len(self._compiled)}(*args):\n    return fn(*args, **static)\n", ns)
                    f = torch.compile(ns[f"_hvd_kernel_{len(self._compiled)}"], dynamic=False)
                    self._compiled[key] = f
        return f

    def __call__(self, numel: int, device, *args, **static):
        if self.failed is None and compile_enabled(numel, device):
            try:
                f = self._get(args, static)
                if f is not None:
                    return f(*args)
            except Exception as e:  # no C++ compiler, unsupported op, ...: eager from now on
                self.failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"hvd_ext: torch.compile of the {self.name} codec kernel failed, running it "
                              f"eagerly from now on ({self.failed.splitlines()[0][:200]})", RuntimeWarning,
                              stacklevel=2)
        return self.fn(*args, **static)


# ---- counter-based uniform numbers (the hash: ``ops.hashing``) -------------------------------

def stream_key_tensor(seed: int, name: str, rank: int, step: int) -> torch.Tensor:
    """0-d int32 key of the stream of (seed, name, rank, step): ``kernels.stream_key(derive_seed(...), step)``,
    as the CUDA quantizers use. A CPU scalar tensor: usable with tensors on any device, nothing to copy
    (and compiled kernels take it as an input, not as a constant to specialise on)."""
    key = _K.stream_key(_K.derive_seed(seed, name, rank), step)
    return torch.tensor(signed32(key), dtype=torch.int32)


def uniform(numel: int, key: torch.Tensor, device=None) -> torch.Tensor:
    """float32 uniform numbers in [0, 1) with 24 random bits: element i is ``hash32(i, key) >> 8`` / 2^24
    (equal to ``kernels.uniform(key, arange(numel))``)."""
    if numel >= (1 << 16) and not torch.compiler.is_compiling():
        return _uniform_inplace(numel, key, device)
    i = torch.arange(numel, dtype=torch.int32, device=device)
    return ((hash32(i, key) >> 8) & 0xFFFFFF).to(torch.float32) * (2.0 ** -24)


def _uniform_inplace(numel: int, key: torch.Tensor, device=None) -> torch.Tensor:
    """Eager :func:`uniform` for large tensors: the same hash on one int32 buffer and one temporary,
    in place (the eager fallback would otherwise map a fresh temporary per operation)."""
    h = torch.arange(numel, dtype=torch.int32, device=device)
    mix32_(h.bitwise_xor_(key), torch.empty_like(h))
    h.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)
    return h.to(torch.float32).mul_(2.0 ** -24)


# ---- bit packing: eight codes per 64-bit word (the arithmetic: ``ops.bits``) ----------------------
#
# Codes are first written one per byte (uint8, padded with zeros to a multiple of 8) into a reused
# buffer; the word-level functions of ``ops.bits`` (``pack_words`` / ``unpack_words``) run compiled
# on its int64 view, and the byte-level steps around them (``words_to_bytes`` / ``bytes_to_words``)
# are bits.py's too, with the temporaries taken from :func:`scratch`.

_PACK = Kernel(_bits.pack_words, "bit packing")
_UNPACK = Kernel(_bits.unpack_words, "bit unpacking")


def codes_buffer(purpose: str, n: int, device) -> torch.Tensor:
    """A reused uint8 buffer for n one-byte codes, padded with zeros to a multiple of 8 (write the
    codes into ``buf[:n]``)."""
    g = (n + 7) // 8
    buf = scratch(purpose, 8 * g, torch.uint8, device)
    if 8 * g > n:
        buf[n:].zero_()
    return buf


def pack_buffer(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Pack the first n one-byte codes of ``buf`` (from :func:`codes_buffer`) into ceil(n*bits/8) bytes
    (bit order contract of ``bitpack``). Returns a fresh uint8 tensor."""
    nbytes = (n * bits + 7) // 8
    if bits == 8:
        return buf[:n].clone()
    w = buf.view(torch.int64)
    return _bits.words_to_bytes(_PACK(w.numel(), buf.device, w, bits=bits), bits, nbytes)


def unpack_to_buffer(data: torch.Tensor, bits: int, n: int, purpose: str) -> torch.Tensor:
    """The n one-byte codes of a packed stream (bit order contract), in a reused uint8 buffer
    (valid until the next call with the same ``purpose``)."""
    g = (n + 7) // 8
    if bits == 8:
        return data[:n]
    out = scratch(purpose, 8 * g, torch.uint8, data.device)

    def buffer(tag: str, numel: int) -> torch.Tensor:
        return scratch(purpose + tag, numel, torch.uint8, data.device)
    words = _bits.bytes_to_words(data[:(n * bits + 7) // 8], bits, g, buffer)
    out.view(torch.int64).copy_(_UNPACK(n, data.device, words, bits=bits))
    return out[:n]


# ---- scratch buffers --------------------------------------------------------------------------

_SCRATCH: Dict[Tuple, torch.Tensor] = {}


def scratch(purpose: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A reused 1-D buffer of ``numel`` elements for a temporary (contents undefined). One buffer per
    (purpose, dtype, device, thread); grown when a larger one is asked for."""
    key = (purpose, dtype, str(device), threading.get_ident())
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _SCRATCH[key] = buf
    return buf[:numel]


SUM_CHUNK = 1 << 18  # float32 elements per pass of ``sum_float32`` on CPU (1 MiB: stays in L2)


def sum_float32(rows: Sequence[torch.Tensor], scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(rows[0] + rows[1] + ...) * scale`` accumulated in float32, rank order, written to ``out``
    (float32 by default; a half-precision ``out`` re-rounds the result as a half-precision ring sum would). The
    rows are 1-D, of one length, in any floating dtype (float16 / bfloat16 from the wire).

    The same values, bit for bit, as ``t = rows[0].float(); t.add_(r) ...; t.mul_(scale)``; on CPU
    it runs over cache-sized chunks, so each element goes through memory once instead of once per
    operation."""
    n = rows[0].numel()
    dev = rows[0].device
    if out is None:
        out = empty(n, torch.float32, dev)
    step = max(1, n if dev.type != "cpu" else SUM_CHUNK)
    direct = out.dtype == torch.float32
    for s in range(0, n, step):
        e = min(n, s + step)
        a = out[s:e] if direct else scratch("sum_float32", e - s, torch.float32, dev)
        a.copy_(rows[0][s:e])
        for r in rows[1:]:
            a.add_(r[s:e])
        if scale != 1.0:
            a.mul_(scale)
        if not direct:
            out[s:e].copy_(a)
    return out


def padded(codes: torch.Tensor, total: int, purpose: str) -> torch.Tensor:
    """``codes`` followed by zeros up to ``total`` elements, in a reused buffer (``codes`` itself when
    it already has ``total``). Kernels get whole (k, c) chunk grids this way: they never slice a
    padded grid back to n inside (inductor can drop the partial last chunk of such a slice written to
    an output), the caller slices the result."""
    n = codes.numel()
    if n == total:
        return codes
    buf = scratch(purpose, total, codes.dtype, codes.device)
    buf[:n].copy_(codes)
    buf[n:].zero_()
    return buf


def empty(numel: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """``torch.empty`` for a dense result; on Linux a large CPU buffer is advised to use transparent
    huge pages (madvise MADV_HUGEPAGE, what torch's own THP_MEM_ALLOC_ENABLE does), which makes first
    touching it several times cheaper than 4 KiB page faults. Advisory only: errors are ignored."""
    t = torch.empty(numel, dtype=dtype, device=device)
    if t.device.type == "cpu" and numel * t.element_size() >= (8 << 20) and _madvise is not None:
        H = 2 << 20
        p = t.data_ptr()
        a, e = (p + H - 1) & ~(H - 1), (p + numel * t.element_size()) & ~(H - 1)
        if e > a:
            try:
                _madvise(a, e - a, 14)  # MADV_HUGEPAGE
            except Exception:
                pass
    return t


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.madvise
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        f.restype = ctypes.c_int
        return f
    except Exception:
        return None


_madvise = _load_madvise()
