"""1-bit SGD (Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs").

Quantization threshold 0: each coordinate of the error-compensated gradient
``p = g + e`` sends one bit (1 for ``p_i >= 0``), and two reconstruction values
are sent per tensor: the mean of the coordinates with bit 1 and the mean of
those with bit 0 (this minimizes the squared error for the given bits).
Error feedback (``feedback=residual``, the default) keeps ``e <- p - sent``.

Wire bytes (allgather, fixed size): ``8 + ceil(n / 8)`` (two float32 values + bits).
"""
from __future__ import annotations

import torch

from .. import kernels as _K
from .base import Compressor, as_bytes, from_bytes, register
from .bitpack import packed_bytes


@register("onebit")
class OneBitCompressor(Compressor):
    exchange = "allgather"
    default_feedback = "residual"

    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device), None
        pos = flat >= 0
        npos = pos.sum()
        sp = torch.where(pos, flat, torch.zeros_like(flat)).sum()
        sn = flat.sum() - sp
        vpos = sp / npos.clamp(min=1)
        vneg = sn / (n - npos).clamp(min=1)
        vals = torch.stack([vneg, vpos]).float()
        # kernels.sign_pack: bit 1 iff flat >= 0, i.e. exactly ``pos`` (kernel on CUDA, bitpack else)
        return as_bytes(vals, _K.sign_pack(flat)), None

    def decode(self, data, ctx, info):
        n = info.numel
        if n == 0:
            return torch.zeros(0, device=data.device)
        vals, off = from_bytes(data, 0, torch.float32, 2)
        bits = _K.unpack_bits(data[off:], 1, n).long()
        return vals[bits]

    def wire_bytes(self, numel):
        return (8 + packed_bytes(numel, 1)) if numel else 0
