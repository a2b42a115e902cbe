"""The 32-bit integer hash of the counter-based random numbers: THE torch (and Python int) implementation.

``mix32`` is the finaliser "lowbias32" (C. Wellons, "Prospecting for hash functions", 2018), the
same function as ``mix32`` in ``kernels/common.cuh``::

    x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16     (mod 2^32)

Its steps are written once (``_STEPS``) and run by three forms: :func:`mix32_int` on Python ints
(stream keys and seeds), :func:`mix32` on int32 tensors (wrapping multiplies; the logical shifts
by masking the sign bits the arithmetic shift brings in; traced and fused by ``torch.compile``)
and :func:`mix32_` in place on one int32 buffer and one temporary (large eager calls). An int32
tensor holds the 32-bit value in two's complement: ``h & 0xFFFFFFFF`` (in int64) is the unsigned
value. Users: ``ops.cpu_kernels.uniform`` (the CPU codecs' stochastic rounding),
``ops.cuda_kernels.hash_u32`` / ``stream_key`` / ``derive_seed`` (the references of the CUDA
kernels, int64 indices) and the natural codec's device path (:func:`hash32`).
"""
from __future__ import annotations

import torch

__all__ = ["M32", "signed32", "mix32_int", "mix32", "mix32_", "hash32"]

M32 = 0xFFFFFFFF

# lowbias32: (shift, the bits ``h >> shift`` keeps of a 32-bit value, odd multiplier as a signed int32
# or None) per step; the multipliers 0x7FEB352D and 0x846CA68B
_STEPS = ((16, 0xFFFF, 0x7FEB352D), (15, 0x1FFFF, 0x846CA68B - (1 << 32)), (16, 0xFFFF, None))


def signed32(v: int) -> int:
    """The int32 (two's complement) value of ``v mod 2^32``."""
    v &= M32
    return v - (1 << 32) if v >= (1 << 31) else v


def mix32_int(x: int) -> int:
    """lowbias32 of ``x mod 2^32``, as a Python int in [0, 2^32)."""
    x &= M32
    for shift, _, mul in _STEPS:
        x ^= x >> shift
        if mul is not None:
            x = (x * mul) & M32
    return x


def mix32(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 of each element of an int32 tensor (result int32, two's complement)."""
    for shift, mask, mul in _STEPS:
        h = h ^ ((h >> shift) & mask)
        if mul is not None:
            h = h * mul
    return h


def mix32_(h: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` in place on the int32 tensor ``h``, with ``tmp`` (same shape) as the one temporary."""
    for shift, mask, mul in _STEPS:
        torch.bitwise_right_shift(h, shift, out=tmp)
        h.bitwise_xor_(tmp.bitwise_and_(mask))
        if mul is not None:
            h.mul_(mul)
    return h


def hash32(i: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """lowbias32(i ^ key) on int32 tensors (``key``: a 0-d int32 tensor or an int32 value)."""
    return mix32(i ^ key)
