"""EF-signSGD (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes").

Each rank sends the scaled sign ``(||p||_1 / n) * sign(p)`` of its
error-compensated gradient ``p = g + e`` (``feedback=residual`` by default keeps
``e <- p - sent``); the ranks' scaled signs are averaged. Sign bit 1 means
``p_i >= 0``.

Wire bytes (allgather, fixed size): ``4 + ceil(n / 8)`` (float32 scale + sign bits).
"""
from __future__ import annotations

import torch

from .base import Compressor, as_bytes, from_bytes, register
from .bitpack import packed_bytes
from .signsgd import bits_to_sign, sign_bits


@register("efsignsgd")
class EFSignSGDCompressor(Compressor):
    exchange = "allgather"
    default_feedback = "residual"

    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device), None
        scale = (flat.abs().sum() / n).reshape(1)
        return as_bytes(scale, sign_bits(flat)), None

    def decode(self, data, ctx, info):
        n = info.numel
        if n == 0:
            return torch.zeros(0, device=data.device)
        s, off = from_bytes(data, 0, torch.float32, 1)
        return bits_to_sign(data[off:], n) * s

    def wire_bytes(self, numel):
        return (4 + packed_bytes(numel, 1)) if numel else 0
