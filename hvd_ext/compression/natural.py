"""Natural compression (Horvath et al. 2019, "Natural Compression for Distributed Deep Learning").

Every coordinate is rounded stochastically to one of the two neighbouring
powers of two: for ``2^e <= |x| < 2^(e+1)`` it becomes ``sign(x) 2^(e+1)`` with
probability ``(|x| - 2^e) / 2^e`` and ``sign(x) 2^e`` otherwise, so
``E[C(x)] = x`` (unbiased, variance at most x^2/8). In float32 terms the
mantissa is dropped and the 8-bit exponent rounded up with probability
``mantissa / 2^23``; subnormals round to 0 or 2^-126 the same way (unbiased).
Values whose exponent would round past the float32 range become inf.

Payload: 1 sign bit per element (packed) then one uint8 biased exponent per
element (0 encodes zero) -- the paper's 9 bits per float.
Wire bytes (allgather, fixed size): ``ceil(n / 8) + n``.
"""
from __future__ import annotations

import torch

from ..ops import cuda_kernels as _K
from ..options import Option, non_negative
from ..ops.device import on_host
from . import _quant
from ..ops import cpu_kernels as _cpu
from .base import Compressor, register
from ..ops.bits import packed_bytes
from ..ops.hashing import hash32

_MANT = 1 << 23


@register("natural")
class NaturalCompressor(Compressor):
    collective = "allgather"
    options = {"seed": Option(int, 0, "integer >= 0", non_negative)}

    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float().contiguous()
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device), None
        bits = flat.view(torch.int32).long() & 0xFFFFFFFF
        sign = (bits >> 31).to(torch.uint8)
        exp = (bits >> 23) & 0xFF
        mant = bits & (_MANT - 1)
        if on_host(flat):  # 23 random bits per element from a generator of (seed, step, name, rank)
            g = _quant.generator(self.seed, info.step, info.name, info.rank)
            u = torch.randint(0, _MANT, (n,), generator=g)
        else:  # on a device from the counter hash (no generator there, nothing to copy)
            key = _cpu.stream_key_tensor(self.seed, info.name, info.rank, info.step)
            u = hash32(torch.arange(n, dtype=torch.int32, device=flat.device), key) & (_MANT - 1)
        sub = exp == 0  # zero or subnormal: |x| = mant * 2^-149, round to 0 or 2^-126 (exp 1)
        up = u < mant
        exp = exp + up.long()
        exp = torch.where(sub, up.long() & (mant > 0).long(), exp)
        exp = exp.clamp(max=255)
        return torch.cat([_K.pack_bits(sign, 1), exp.to(torch.uint8)]), None

    def decode(self, data, ctx, info):
        n = info.numel
        if n == 0:
            return torch.zeros(0, device=data.device)
        nb = packed_bytes(n, 1)
        sign = _K.unpack_bits(data[:nb], 1, n).to(torch.int64)
        exp = data[nb:nb + n].to(torch.int64)
        bits = (sign << 31) | (exp << 23)
        bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
        return bits.view(torch.float32).clone()

    def wire_bytes(self, numel):
        return packed_bytes(numel, 1) + numel
